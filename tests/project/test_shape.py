"""The package keeps its shape: the tables that choose modes and policies by name
agree with the names the options' types give, and scripts/shape.py (sizes,
import circles) passes."""

from __future__ import annotations

import subprocess
import sys
from typing import get_args

from django_tasklock.conf import (
    CONTENTION_POLICIES,
    DECORATOR_CONTENTION,
    TIMEOUT_POLICIES,
)
from django_tasklock.modes import MODES
from django_tasklock.options import (
    DUPLICATE_NAMES,
    MODE_NAMES,
    ModeName,
    OnContention,
    OnDuplicate,
)
from django_tasklock.policies import CONTENTION, DUPLICATES
from tests.helpers import ROOT


def test_every_mode_name_has_a_mode_and_every_mode_a_name():
    assert tuple(MODES) == MODE_NAMES == get_args(ModeName)
    assert all(mode.name == name for name, mode in MODES.items())


def test_every_policy_name_has_a_policy():
    # The setting's choices, and park, which only a decorator may name.
    assert tuple(CONTENTION) == DECORATOR_CONTENTION == (*CONTENTION_POLICIES, "park")
    assert set(TIMEOUT_POLICIES) <= set(CONTENTION)
    assert tuple(DUPLICATES) == DUPLICATE_NAMES == get_args(OnDuplicate)
    assert tuple(CONTENTION) == get_args(OnContention)


def test_no_class_or_function_over_its_limit_and_no_import_circle():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "shape.py")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "import circles: 0" in result.stdout
    assert "layer violations: 0" in result.stdout


def test_the_shape_script_finds_a_circle_an_oversized_function_and_a_layer_broken(
    tmp_path,
):
    # The check itself can fail: a package with each is refused.
    package = tmp_path / "django_tasklock"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text(
        "from . import a\n\n\ndef big():\n" + "    x = 1\n" * 61
    )
    (package / "c.py").write_text("def lazy():\n    from . import a\n")
    docs = tmp_path / "docs" / "explanation"
    docs.mkdir(parents=True)
    (docs / "architecture.rst").write_text(
        ".. layers-start\n\n    top: (package) a\n    bottom: b\n\n.. layers-end\n"
    )
    script = tmp_path / "scripts" / "shape.py"
    script.parent.mkdir()
    script.write_text((ROOT / "scripts" / "shape.py").read_text())
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 1
    assert "django_tasklock.a <-> django_tasklock.b" in result.stdout
    assert "over the limit: django_tasklock.b:big (62 lines)" in result.stdout
    assert "django_tasklock.c is in no layer" in result.stdout
    assert (
        "django_tasklock.b (bottom) imports django_tasklock.a, a layer above (top)"
        in result.stdout
    ), result.stdout


def test_every_rate_kind_name_has_a_kind():
    from django_tasklock.conf import RATE_KINDS
    from django_tasklock.limits.kinds import KINDS

    assert tuple(KINDS) == RATE_KINDS
    assert all(kind.name == name for name, kind in KINDS.items())
