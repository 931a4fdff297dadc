"""Delta updates against a real server: a worker holding one published revision is brought to
the next in place, per tensor nothing, an element patch or the whole tensor; every result
checked against the target's digest (a wrong base is fetched whole); torch modules updated
in place; a patch computed once for every worker."""

from __future__ import annotations

import http.client
import json

import ml_dtypes
import numpy as np
import pytest

from tests.support import publishing
from tests.support.publishing import first_weights
from weightserve.client._client import Client
from weightserve.service.server import WeightServer

server = publishing.server  # the fixture: a server on loopback that takes publishes

MODEL = "team/policy"


def step(weights: dict[str, np.ndarray], density: float, seed: int) -> dict[str, np.ndarray]:
    """The next revision as a training step makes it: ``density`` of the bfloat16 elements
    move, the float32 norm changes everywhere (a patch of every element is still smaller: its
    positions compress to nothing), the head grows (whole), the int8 table stays."""
    rng = np.random.default_rng(seed)
    nxt = {name: array.copy() for name, array in weights.items()}
    w = nxt["layers.0.w"].reshape(-1)
    moved = rng.choice(w.size, int(w.size * density), replace=False)
    w[moved] = (w[moved].astype(np.float32) + 0.5).astype(ml_dtypes.bfloat16)
    nxt["norm"] = rng.standard_normal(nxt["norm"].shape).astype(np.float32)
    nxt["head"] = rng.standard_normal(len(nxt["head"]) + 8).astype(np.float32)
    return nxt


def same_bytes(a: object, b: np.ndarray) -> bool:
    return np.asarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def test_an_update_sends_a_patch_and_lands_in_place(server: WeightServer) -> None:
    r1_weights = first_weights()
    r2_weights = step(r1_weights, density=0.01, seed=1)
    with Client(server.http_url) as c:
        r1 = c.publish(MODEL, r1_weights)
        r2 = c.publish(MODEL, r2_weights, base=r1.commit)
        state = {name: array.copy() for name, array in r1_weights.items()}
        held = dict(state)
        model = c.model(MODEL)
        got = model.update(state, since=r1.commit)
        assert got.commit == r2.commit
        for name, array in r2_weights.items():
            assert same_bytes(state[name], array), name
            # In place, the same arrays; the head changed shape: a new array.
            assert (state[name] is held[name]) == (name != "head"), name
        done = model.last_update
        assert (done["same"], done["patch"], done["whole"], done["refetched"]) == (1, 2, 1, 0)
        # 1 % of 256 Ki bfloat16 elements: positions and values, far below the tensor.
        assert done["wire_bytes"] < r1_weights["layers.0.w"].nbytes // 10 + 2 * 512 * 4
        kinds = {u.name: u.kind for u in model.iter_updates(since=r1.commit)}
        assert kinds == {"layers.0.w": "patch", "norm": "patch", "embed.q": "same", "head": "whole"}


def test_a_wrong_base_is_fetched_whole_and_an_unknown_one_gets_whole_tensors(
    server: WeightServer,
) -> None:
    r1_weights = first_weights()
    r2_weights = step(r1_weights, density=0.02, seed=2)
    with Client(server.http_url) as c:
        r1 = c.publish(MODEL, r1_weights)
        c.publish(MODEL, r2_weights, base=r1.commit)
        model = c.model(MODEL)
        state = {name: array.copy() for name, array in r1_weights.items()}
        state["embed.q"][0, 0] += 1  # not what r1 holds: the worker's base is wrong there
        old, new = (w["layers.0.w"].view(np.uint16).reshape(-1) for w in (r1_weights, r2_weights))
        state["layers.0.w"].reshape(-1)[np.flatnonzero(old == new)[0]] = 7.0  # not patched
        model.update(state, since=r1.commit)
        assert model.last_update["refetched"] == 2
        assert all(same_bytes(state[n], a) for n, a in r2_weights.items())
        fresh = {name: array.copy() for name, array in r1_weights.items()}
        model.update(fresh, since="0" * 40)  # a revision the server never held
        assert model.last_update["whole"] == 4
        assert all(same_bytes(fresh[n], a) for n, a in r2_weights.items())


def test_a_patch_is_computed_once_for_every_worker(server: WeightServer) -> None:
    r1_weights = first_weights()
    with Client(server.http_url) as c:
        r1 = c.publish(MODEL, r1_weights)
        c.publish(MODEL, step(r1_weights, density=0.01, seed=3), base=r1.commit)
        model = c.model(MODEL)
        for _ in range(3):  # three workers
            model.update({n: a.copy() for n, a in r1_weights.items()}, since=r1.commit)
        assert server.state.deltas.computed == len(r1_weights)


def test_a_torch_module_is_updated_in_place(server: WeightServer) -> None:
    torch = pytest.importorskip("torch")
    trainer = torch.nn.Linear(256, 128).to(torch.bfloat16)
    worker = torch.nn.Linear(256, 128).to(torch.bfloat16)
    worker.load_state_dict(trainer.state_dict())
    weight = worker.weight
    with Client(server.http_url) as c:
        r1 = c.publish(MODEL, trainer.state_dict())
        with torch.no_grad():
            flat = trainer.weight.view(-1)
            flat[::97] += 1.0  # about 1 % of the elements
        r2 = c.publish(MODEL, trainer.state_dict(), base=r1.commit)
        model = c.model(MODEL)
        assert model.update(worker.state_dict(), since=r1.commit).commit == r2.commit
    assert worker.weight is weight
    assert torch.equal(worker.weight, trainer.weight) and torch.equal(worker.bias, trainer.bias)
    assert model.last_update["patch"] == 1 and model.last_update["same"] == 1
    out = worker(torch.ones(1, 256, dtype=torch.bfloat16))  # the module keeps working
    assert out.shape == (1, 128)


def test_read_only_arrays_still_take_patches(server: WeightServer) -> None:
    # A same-node load hands out read-only pages: the update patches copies, never refetches.
    r1_weights = first_weights()
    r2_weights = step(r1_weights, density=0.01, seed=4)
    with Client(server.http_url) as c:
        r1 = c.publish(MODEL, r1_weights)
        c.publish(MODEL, r2_weights, base=r1.commit)
        state = {name: array.copy() for name, array in r1_weights.items()}
        for array in state.values():
            array.flags.writeable = False
        unchanged = state["embed.q"]
        model = c.model(MODEL)
        model.update(state, since=r1.commit)
    done = model.last_update
    assert (done["same"], done["patch"], done["whole"], done["refetched"]) == (1, 2, 1, 0)
    assert state["embed.q"] is unchanged  # same digest: left as it is, not copied
    assert all(same_bytes(state[n], a) for n, a in r2_weights.items())


def test_a_torch_tensor_not_writable_where_it_is_is_patched_and_copied_back(
    server: WeightServer,
) -> None:
    # The path a GPU tensor takes (patched in a host copy, then copy_ into it), here with a
    # tensor that is not contiguous, whose memory cannot be written as flat bytes either.
    torch = pytest.importorskip("torch")
    r1_weights = first_weights()
    r2_weights = step(r1_weights, density=0.01, seed=5)
    with Client(server.http_url) as c:
        r1 = c.publish(MODEL, r1_weights)
        c.publish(MODEL, r2_weights, base=r1.commit)
        w1 = torch.from_numpy(r1_weights["layers.0.w"].view(np.int16).copy()).view(torch.bfloat16)
        weight = w1.T.contiguous().T  # the same values, laid out column by column
        storage = weight.data_ptr()
        state = {name: torch.from_numpy(array.copy()) for name, array in r1_weights.items()
                 if name != "layers.0.w"}  # fmt: skip
        state["layers.0.w"] = weight
        model = c.model(MODEL)
        model.update(state, since=r1.commit)
    assert not weight.is_contiguous()
    assert state["layers.0.w"] is weight and weight.data_ptr() == storage
    expected = torch.from_numpy(r2_weights["layers.0.w"].view(np.int16).copy())
    assert torch.equal(weight.view(torch.int16), expected)
    done = model.last_update
    assert (done["patch"], done["refetched"]) == (2, 0)


def test_the_wire_form_is_readable_without_the_client(server: WeightServer) -> None:
    """Headers and payload sizes as docs/protocol.md states them, read with http.client."""
    r1_weights = first_weights()
    with Client(server.http_url) as c:
        r1 = c.publish(MODEL, r1_weights)
        r2 = c.publish(MODEL, step(r1_weights, 0.01, 4), base=r1.commit)
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port)
    conn.request("GET", f"/v1/models/{MODEL}/-/delta?since={r1.commit}")
    reply = conn.getresponse()
    assert reply.getheader("x-weightserve-commit") == r2.commit
    assert reply.getheader("x-weightserve-delta-base") == r1.commit
    seen = {}
    while line := reply.readline():
        header = json.loads(line)
        size = {"same": 0, "whole": header["nbytes"]}.get(
            header["kind"], header["positions_bytes"] + header["values_bytes"]
        )
        assert len(reply.read(size)) == size
        seen[header["name"]] = header["kind"]
    assert seen == {"layers.0.w": "patch", "norm": "patch", "embed.q": "same", "head": "whole"}
    conn.close()


def test_a_zero_dim_array_keeps_no_dimensions(server: WeightServer) -> None:
    """A 0-dim array (a step counter, a scale) is published as shape [] and read back 0-dim;
    a torch module's 0-dim buffer is updated in place as the 0-dim tensor it is."""
    torch = pytest.importorskip("torch")
    weights = dict(first_weights(), scale=np.array(0.5, np.float32))
    with Client(server.http_url) as c:
        r1 = c.publish(MODEL, weights)
        model = c.model(MODEL)
        assert tuple(model.tensors["scale"].shape) == ()
        got = model.fetch(["scale"])["scale"]
        assert got.shape == () and float(got) == 0.5
        trainer = torch.nn.Linear(8, 4)
        trainer.register_buffer("steps", torch.tensor(3, dtype=torch.int64))
        trainer.register_buffer("none", torch.zeros(0))
        worker = torch.nn.Linear(8, 4)
        worker.register_buffer("steps", torch.tensor(3, dtype=torch.int64))
        worker.register_buffer("none", torch.zeros(0))
        worker.load_state_dict(trainer.state_dict())
        t1 = c.publish(MODEL, trainer.state_dict())
        with torch.no_grad():
            trainer.steps += 1
        t2 = c.publish(MODEL, trainer.state_dict(), base=t1.commit)
        state = worker.state_dict()
        buffer = state["steps"]
        assert c.model(MODEL).update(state, since=t1.commit).commit == t2.commit
    assert state["steps"] is buffer and isinstance(state["steps"], torch.Tensor)
    assert state["steps"].shape == () and int(worker.steps) == 4
    # A state that held it as shape [1] (as such arrays were once published) gets the 0-dim
    # tensor whole, and a torch tensor still.
    with Client(server.http_url) as c:
        state = {n: t.clone() for n, t in worker.state_dict().items()}
        state["steps"] = torch.tensor([3], dtype=torch.int64)
        state["none"] = torch.zeros(2)  # another shape: it comes whole, empty
        c.model(MODEL).update(state, since=t1.commit)
    assert isinstance(state["steps"], torch.Tensor), type(state["steps"])
    assert state["steps"].shape == () and int(state["steps"]) == 4
    assert isinstance(state["none"], torch.Tensor) and state["none"].shape == (0,)
    assert r1.commit != t1.commit
