"""The PostgreSQL store's table (``backends.postgres.statements``), made on
PostgreSQL databases only: on others the migration does nothing."""

from typing import Any

from django.db import migrations

from django_tasklock.backends.postgres.statements import CREATE, DROP


def create(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def drop(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("django_tasklock", "0001_initial")]

    operations = [migrations.RunPython(create, drop, elidable=False)]
