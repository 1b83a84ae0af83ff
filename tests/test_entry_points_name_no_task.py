"""The entry points ask the model which tasks it has and let each task write, draw and report (bev.tasks.task.Task's
hooks): none names a task. Read with `ast`, so docstrings and messages may mention tasks; code may not."""

import ast
from pathlib import Path

import pytest

from bev.tasks import TASKS

REPO = Path(__file__).resolve().parents[1]
ENTRY_POINTS = ("bev/eval.py", "bev/predict_cli.py", "bev/export.py", "bev/inference.py")

# (file, what is named) -> why it must be. Empty: every entry point asks its tasks.
ALLOWED: dict[tuple[str, str], str] = {}


def _named_tasks(source: str) -> list[tuple[int, str]]:
    """(line, what) for each place the code names a task: a string literal that is a task's name, an attribute
    or keyword argument of that name (model.task_modules.occupancy), an import from a task's package."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and node.value in TASKS:
            found.append((node.lineno, repr(node.value)))
        elif isinstance(node, ast.Attribute) and node.attr in TASKS:
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.keyword) and node.arg in TASKS:
            found.append((node.value.lineno, f"{node.arg}="))
        elif isinstance(node, ast.ImportFrom | ast.Import):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            found += [(node.lineno, m) for m in modules if set(m.split(".")[2:3]) & set(TASKS)]
    return found


@pytest.mark.parametrize("path", ENTRY_POINTS)
def test_an_entry_point_names_no_task(path):
    named = [(line, what) for line, what in _named_tasks((REPO / path).read_text()) if (path, what) not in ALLOWED]
    assert not named, f"{path} names tasks at " + ", ".join(f"line {line}: {what}" for line, what in named)


@pytest.mark.parametrize(
    "code",
    [
        'if "occupancy" in model.tasks: pass',
        "model.task_modules.detection.track",
        "from bev.tasks.segmentation.metric import format_table",
        "import bev.tasks.motion.instances",
        "f(motion=None)",
    ],
)
def test_the_check_finds_a_named_task(code):
    assert _named_tasks(code)


def test_the_check_passes_what_names_none():
    assert not _named_tasks('"""occupancy in a docstring"""\nx = "no segmentation head"\nfrom bev.tasks import TASKS')
