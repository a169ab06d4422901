"""Dynamo guard evaluation for compiled forwards: the process-wide ``skip_guard_eval_unsafe`` stance
(``compile.skip_guards``) and the contexts that restore full guards wherever something may compile.

Its own module so that the model runner and any attention backend that compiles parts of its eager path
(``attention=flex``) share one switch without importing each other.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def _can_skip_guards() -> bool:
    """True when this torch can run only the guards that tell compiled entries apart (see ModelRunner.forward)."""
    try:
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=False):
            return True
    except (TypeError, AttributeError):
        return False


CAN_SKIP_GUARDS = _can_skip_guards()

_SKIP_STANCE_SET = False  # a runner put the process in the skip_guard_eval_unsafe stance


def skip_guards_process_wide() -> None:
    """Put the whole process in torch's ``skip_guard_eval_unsafe`` stance (switching it per call costs as much as
    the guards themselves); :func:`guarded_if_skipping` then restores full guards where needed."""
    global _SKIP_STANCE_SET
    torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    _SKIP_STANCE_SET = True


def restore_guards_process_wide() -> None:
    """Undo :func:`skip_guards_process_wide` (tests that must not leave the stance behind)."""
    global _SKIP_STANCE_SET
    torch.compiler.set_stance("default", skip_guard_eval_unsafe=False)
    _SKIP_STANCE_SET = False


def full_guards() -> Any:
    """A context in which torch.compile'd code evaluates all of its guards (and may compile)."""
    return torch.compiler.set_stance("default", skip_guard_eval_unsafe=False)


def guarded_if_skipping() -> Any:
    """Full guards when some runner set the skip stance (a no-op context otherwise): for calls that may compile
    (eager forwards whose backend compiles parts, runners with ``compile.skip_guards=false``)."""
    return full_guards() if _SKIP_STANCE_SET else contextlib.nullcontext()


def input_signature(value: Any) -> Any:
    """What dynamo's guards on ``value`` depend on, as a hashable key: tensors by dtype, device and shape, Python
    scalars by value, containers and metadata objects field by field."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.device, tuple(value.shape)
    if value is None or isinstance(value, (int, float, str, bool)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(input_signature(v) for v in value)
    return type(value), tuple(input_signature(v) for v in vars(value).values())
