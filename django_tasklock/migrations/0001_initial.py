"""The lock console's model: no table (``managed = False``), its permissions only."""

from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies = []

    operations = [
        migrations.CreateModel(
            name="HeldLock",
            fields=[
                (
                    "lock_id",
                    models.CharField(max_length=250, primary_key=True, serialize=False),
                ),
            ],
            options={
                "verbose_name": "held lock",
                "verbose_name_plural": "held locks",
                "managed": False,
                "default_permissions": ("view", "delete"),
            },
        ),
    ]
