"""What a stream's group (:mod:`batchq.protocol.groups`) adds to its checkpoint and its
options: a state names its group, the groups resuming one checkpoint resume into one
run, and ``set_params`` is refused in a run read by several groups. The group's claim
and resume are the :class:`consumer.session.Session`'s.
"""

from __future__ import annotations

import hashlib
from typing import Any

from batchq.errors import ConfigError
from consumer.session import Session
from consumer.state_keys import GROUP_KEY

__all__ = ["check_group_state", "group_resume_run_id", "refuse_params"]


def check_group_state(state: dict[str, Any], group: str | None) -> dict[str, Any]:
    """A checkpoint's state for a stream of ``group``: refused when it names another
    group (each group's position is its own); a state without a group (the default
    group's, or saved before groups) is taken as it is.

    Raises:
        ConfigError: the state names another group.
    """
    saved = state.get(GROUP_KEY)
    if saved is not None and saved != (group or ""):
        raise ConfigError(
            f"state is of group {saved or '(default)'!r}, this stream reads group "
            f"{group or '(default)'!r}; expected a state_dict() of the same group"
        )
    return state


def refuse_params(session: Session | None) -> None:
    """``set_params`` is not for a run read by several groups: one build serves every
    group, so no group may steer the producers for itself.

    Raises:
        ConfigError: the session reads a group of such a run.
    """
    if session is not None and session.grouped:
        raise ConfigError(
            f"{session.what}: set_params changes what the producers build for every group "
            "of the run (each batch is built once for all): not supported in a run read by "
            "several groups"
        )


def group_resume_run_id(state: dict[str, Any], world: int) -> str:
    """The run the groups (and ranks) resuming one checkpoint's run resume into: the same
    for all, so the first creates it and the others join it (as
    :func:`consumer.rank_state.resume_run_id`, for any world)."""
    text = f"resume:{state.get('run')}:{world}"
    return hashlib.sha1(text.encode()).hexdigest()[:16]
