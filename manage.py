#!/usr/bin/env python
"""Django's command-line utility for this repository.

Until the example project exists it runs with the test settings, e.g.
``python manage.py check`` shows django_tasklock's system checks.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
