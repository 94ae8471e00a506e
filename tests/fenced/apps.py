from django.apps import AppConfig


class FencedConfig(AppConfig):
    name = "tests.fenced"
    label = "fenced"
    default_auto_field = "django.db.models.BigAutoField"
