"""The app as a project meets it: checks, refusals, docs, the example, packaging."""
