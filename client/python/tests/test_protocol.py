"""fusedps.ParameterServiceClient: fusedps.Client and fusedps.ShardedClient both satisfy it.

mypy checks the same (fusedps/_protocol.py assigns both to the Protocol type; CI's
scripts/check_python.sh). Here each method of the Protocol is compared with each class's by
inspect: a call written against the Protocol must bind to the class's method. No server is
needed; the clients' channels connect lazily, and nothing here calls a server.
"""

from __future__ import annotations

import importlib.util
import inspect
import re

import pytest

import fusedps
from fusedps import Client, ParameterServiceClient, ShardedClient

_P = inspect.Parameter


def _protocol_methods():
    return sorted(name for name, value in vars(ParameterServiceClient).items()
                  if inspect.isfunction(value) and not name.startswith("_"))


def _mismatches(cls, name: str):
    """Why a call of Protocol method ``name`` (every argument given the way the Protocol lets a
    caller give it) would not bind to ``cls``'s method; empty when it would."""
    method = getattr(cls, name, None)
    if method is None or not callable(method):
        return [f"{cls.__name__} has no method {name}"]
    wanted = list(inspect.signature(getattr(ParameterServiceClient, name)).parameters.values())
    have = list(inspect.signature(method).parameters.values())
    have_by_name = {p.name: p for p in have}
    var_keyword = any(p.kind == _P.VAR_KEYWORD for p in have)
    problems = []
    for i, p in enumerate(wanted):
        if p.kind == _P.POSITIONAL_OR_KEYWORD:  # By position, or by name.
            if i >= len(have) or have[i].name != p.name or have[i].kind != p.kind:
                problems.append(f"{cls.__name__}.{name}: {p.name!r} is not parameter {i}")
                continue
        elif p.kind == _P.KEYWORD_ONLY:
            q = have_by_name.get(p.name)
            if q is None:
                if not var_keyword:
                    problems.append(f"{cls.__name__}.{name}: no keyword {p.name!r}")
                continue  # **kwargs takes it; the Client it forwards to is checked too.
            if q.kind not in (_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY):
                problems.append(f"{cls.__name__}.{name}: {p.name!r} cannot be given by name")
                continue
        elif p.kind == _P.VAR_KEYWORD:  # The class must take any keyword too.
            if not var_keyword:
                problems.append(f"{cls.__name__}.{name}: no **{p.name}")
            continue
        else:
            problems.append(f"the Protocol's {name} has a {p.kind} parameter; compare it here")
            continue
        q = have_by_name[p.name]
        if p.default is not _P.empty and q.default != p.default:
            problems.append(f"{cls.__name__}.{name}: {p.name!r} defaults to {q.default!r}, "
                            f"the Protocol's to {p.default!r}")
    # Whatever the class takes beyond the Protocol must be optional.
    names = {p.name for p in wanted}
    for q in have:
        if q.name not in names and q.default is _P.empty and \
                q.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD):
            problems.append(f"{cls.__name__}.{name}: {q.name!r} is required, the Protocol "
                            "does not give it")
    return problems


def test_the_protocol_has_the_methods_remote_adamw_uses():
    assert _protocol_methods() == sorted([
        "close", "create_model", "delete_model", "load_state", "pull_buffers",
        "pull_parameters", "pull_state", "push_gradients", "register_model",
        "register_param_group", "server_infos", "set_hyperparameters", "wait_ready",
        "write_buffers"])
    assert fusedps.ParameterServiceClient is ParameterServiceClient
    assert "ParameterServiceClient" in fusedps.__all__


@pytest.mark.parametrize("cls", [Client, ShardedClient], ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", _protocol_methods())
def test_each_client_class_has_the_protocols_signature(cls, name):
    assert _mismatches(cls, name) == []


def test_both_classes_and_their_instances_are_protocol_clients():
    assert issubclass(Client, ParameterServiceClient)
    assert issubclass(ShardedClient, ParameterServiceClient)
    # Channels connect lazily: nothing is called on these addresses.
    with Client("127.0.0.1:1") as one, ShardedClient(["127.0.0.1:1", "127.0.0.1:2"]) as two:
        assert isinstance(one, ParameterServiceClient)
        assert isinstance(two, ParameterServiceClient)


def test_a_class_of_another_shape_fails_the_check():
    """The check can fail: a missing method, a parameter moved, a required extra, a default
    changed."""

    class NoInfos(Client):
        server_infos = None

    class Moved:
        def register_model(self, param_group="default", model_or_named_params=None):
            pass

        def wait_ready(self, timeout: float = 10.0, *, probe) -> None:
            pass

        def delete_model(self, name: str, timeout=5.0):
            pass

    assert _mismatches(NoInfos, "server_infos") == ["NoInfos has no method server_infos"]
    assert len(_mismatches(Moved, "register_model")) == 2
    assert _mismatches(Moved, "wait_ready") == [
        "Moved.wait_ready: 'probe' is required, the Protocol does not give it"]
    assert _mismatches(Moved, "delete_model") == [
        "Moved.delete_model: 'timeout' defaults to 5.0, the Protocol's to 60.0"]
    assert not issubclass(Moved, ParameterServiceClient)


def test_remote_adamw_calls_only_protocol_methods_on_its_client():
    """Every method fusedps.torch and fusedps._remote_optim call on a client is one of the
    Protocol's (read from their source; fusedps.torch is not imported)."""
    called = set()
    for module in ("fusedps.torch", "fusedps._remote_optim"):
        with open(importlib.util.find_spec(module).origin, encoding="utf-8") as f:
            called |= set(re.findall(r"\bclient\.(\w+)\(", f.read()))
    assert called, "no client calls found: the pattern is out of date"
    assert called <= set(_protocol_methods()), called - set(_protocol_methods())
