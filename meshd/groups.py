"""The exception groups trio's nurseries raise, taken apart to find a failure's cause."""

from __future__ import annotations


def leaves(group: BaseExceptionGroup) -> list[BaseException]:
    """The exceptions in ``group`` and in the groups inside it, in order, groups left out."""
    return [leaf for e in group.exceptions for leaf in (leaves(e) if isinstance(e, BaseExceptionGroup) else [e])]
