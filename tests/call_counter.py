"""A test helper: count the calls of some attributes of an object or module, still calling them."""

from collections import Counter


def count_calls(monkeypatch, owner: object, names: tuple[str, ...]) -> Counter:
    """Wrap ``owner.<name>`` for each name so every call is counted under its name; returns the counter."""
    calls: Counter = Counter()
    for name in names:
        original = getattr(owner, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    return calls
