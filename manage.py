#!/usr/bin/env python
"""Django's command-line utility for the example project (example_project/).

``python manage.py feeds_demo`` runs the demo ``make demo`` runs; the test suite
uses its own settings (tests/settings.py).
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
