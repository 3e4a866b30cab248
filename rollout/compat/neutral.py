"""The fronts' rule for a peer's arguments: every name the peer defines is accepted; one the engine
honours is translated, any other must hold a neutral value (the peer's default, or an empty value where
the default is empty), else it is refused by name as unsupported. A name the peer does not define is
unknown (TypeError), as Python answers for a keyword no function takes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollout.compat.peer_args import UNSET

EMPTY = (None, False, "", (), [], {})


def is_neutral(value: Any, default: Any) -> bool:
    if default is UNSET:
        return value is None
    if _empty(default):
        return _empty(value)
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default  # True is not a neutral 1
    try:
        return bool(value == default)
    except Exception:  # a value whose == is not a bool (a tensor)
        return False


def _empty(value: Any) -> bool:
    return any(value is e or (type(value) is type(e) and value == e) for e in EMPTY)


def refuse(
    owner: str,
    given: Mapping[str, Any],
    peer: Mapping[str, Any],
    what: str,
    unknown_error: type[Exception] = TypeError,
) -> None:
    """Raise `unknown_error` for names the peer does not define, ValueError for non-neutral values."""
    unknown = sorted(set(given) - set(peer))
    if unknown:
        raise unknown_error(f"{owner} got unknown {what} {unknown}")
    bad = [f"{k}={v!r}" for k, v in given.items() if not is_neutral(v, peer[k])]
    if bad:
        neutral = ", ".join(f"{k}={_shown(peer[k])}" for k in given if not is_neutral(given[k], peer[k]))
        raise ValueError(
            f"{owner}: {what} {', '.join(bad)} unsupported by this engine; accepted only at the neutral "
            f"value ({neutral})"
        )


def _shown(default: Any) -> str:
    return "None" if default is UNSET else repr(default)
