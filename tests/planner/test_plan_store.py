"""Plans cached on disk (jax_blink/planner/store.py): reused across processes' caches, and corrupt,
stale or edited entries ignored and rewritten, never trusted."""

import json

import pytest

import jax_blink
from jax_blink.planner import facade, store
from jax_blink.topology.presets import multi_node


@pytest.fixture
def disk(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_BLINK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("JAX_BLINK_PLAN_CACHE", "1")
    jax_blink.clear_caches()
    calls = []
    real = facade._plan_uncached

    def counting(*a, **k):
        calls.append(a[2])
        return real(*a, **k)

    monkeypatch.setattr(facade, "_plan_uncached", counting)
    yield tmp_path / "plans", calls
    jax_blink.clear_caches()


TOPO = multi_node("dgx1v", 2, 12.5, 1)


def _entry(plans_dir):
    files = sorted(plans_dir.glob("*.json"))
    assert files
    return files


def test_plan_is_loaded_not_planned_again(disk):
    plans, calls = disk
    p = jax_blink.plan(TOPO, "allreduce", algorithm="rsag")
    assert len(calls) == 1 and len(_entry(plans)) == 1
    jax_blink.clear_caches()  # a new process: memory empty, disk full
    q = jax_blink.plan(TOPO, "allreduce", algorithm="rsag")
    assert len(calls) == 1
    assert q == p and q.to_json() == p.to_json()
    # the cost model's choice is cached too (its candidates were planned once)
    c = jax_blink.plan(TOPO, "allreduce", nbytes=1 << 20)
    n = len(calls)
    jax_blink.clear_caches()
    assert jax_blink.plan(TOPO, "allreduce", nbytes=1 << 20) == c and len(calls) == n


def _rewrite(path, edit_header=None, edit_plan=None):
    head, _, text = path.read_bytes().partition(b"\n")
    h = json.loads(head)
    if edit_plan is not None:
        d = edit_plan(json.loads(text))
        text = json.dumps(d).encode()
        h["sha256"] = store.hashlib.sha256(text).hexdigest()  # a consistent checksum: only the check catches it
    if edit_header is not None:
        edit_header(h)
    path.write_bytes(json.dumps(h).encode() + b"\n" + text)


def _overload(d):
    if "composed" in d:  # every column 10 times heavier, rate to match: only the load check catches it
        d["composed"]["spec"]["weights"] = [10 * w for w in d["composed"]["spec"]["weights"]]
        d["rate_gbps"] *= 10
        return d
    d["trees"][0]["weight_gbps"] *= 10
    d["rate_gbps"] = sum(t["weight_gbps"] for t in d["trees"])
    return d


def _detach(d):
    if "composed" in d:  # a column's last intra-node edge dropped: its forest misses a GPU
        d["composed"]["spec"]["columns"][0][0].pop()
        return d
    d["trees"][0]["edges"] = d["trees"][0]["edges"][:-3]
    return d


@pytest.mark.parametrize("damage", ["truncated", "garbage", "nested", "stale", "checksum", "overloaded", "not a tree",
                                    "other devices"])
@pytest.mark.parametrize("topo", [TOPO, "dgx1v"], ids=["composed", "flat"])
def test_bad_entries_are_ignored_and_rewritten(disk, damage, topo):
    plans, calls = disk
    topo = jax_blink.load_topology(topo) if isinstance(topo, str) else topo
    p = jax_blink.plan(topo, "allreduce", algorithm="trees")
    (path,) = _entry(plans)
    good = path.read_bytes()
    assert (b'"composed"' in good) == (topo is TOPO)  # identical nodes: the compact form
    if damage == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00\xff not json")
    elif damage == "nested":  # json's decoder recurses: RecursionError, not ValueError
        path.write_bytes(b"[" * 100_000 + b"\n" + good.partition(b"\n")[2])
    elif damage == "stale":
        _rewrite(path, edit_header=lambda h: h["key"].update(version="0" * 16))
    elif damage == "checksum":
        path.write_bytes(good.replace(b'"rate_gbps": ', b'"rate_gbps": 1', 1))
    elif damage == "overloaded":
        _rewrite(path, edit_plan=_overload)
    elif damage == "not a tree":
        _rewrite(path, edit_plan=_detach)
    else:
        _rewrite(path, edit_plan=lambda d: {**d, "devices": d["devices"][::-1]})
    jax_blink.clear_caches()
    q = jax_blink.plan(topo, "allreduce", algorithm="trees")
    assert len(calls) == 2  # planned again
    assert q == p
    assert path.read_bytes() == good  # and rewritten


def test_composed_entry_is_small_and_loads_the_same_trees(disk):
    """A composed plan's entry is its rule (one node's columns and weights), not its O(N^2) hops; the
    loaded plan builds the same trees as the planned one."""
    plans, calls = disk
    topo = multi_node("dgx1v", 16, 12.5, 4)
    p = jax_blink.plan(topo, "allreduce", algorithm="hierarchical")
    (path,) = _entry(plans)
    assert path.stat().st_size * 50 < len(p.to_json())  # 4 KB against 845 KB of trees (36,864 hops)
    jax_blink.clear_caches()
    q = jax_blink.plan(topo, "allreduce", algorithm="hierarchical")
    assert len(calls) == 1 and q.trees._trees is None
    assert tuple(q.trees) == tuple(p.trees) and q.to_json() == p.to_json()


def test_cache_off_and_unwritable_dir(disk, monkeypatch, tmp_path):
    plans, calls = disk
    monkeypatch.setenv("JAX_BLINK_PLAN_CACHE", "0")
    jax_blink.plan(TOPO, "allreduce", algorithm="trees")
    assert not plans.exists()
    monkeypatch.setenv("JAX_BLINK_PLAN_CACHE", "yes")
    jax_blink.clear_caches()
    with pytest.raises(jax_blink.PlanError, match="JAX_BLINK_PLAN_CACHE='yes': .*takes 0 or 1"):
        jax_blink.plan(TOPO, "allreduce", algorithm="trees")
    monkeypatch.setenv("JAX_BLINK_PLAN_CACHE", "1")
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("JAX_BLINK_CACHE_DIR", str(blocker))  # not a directory: the write fails quietly
    jax_blink.clear_caches()
    assert jax_blink.plan(TOPO, "allreduce", algorithm="trees").rate_gbps > 0


def _restructure(how):
    def edit(d):
        rows = d["composed"]["spec"]["structure"]["nodes"]
        if how == "switches swapped":  # node 1's PCIe switches 0 and 2 exchanged: its routes are no links
            i, j = rows[1].index("n1-pcie-switch-0"), rows[1].index("n1-pcie-switch-2")
            rows[1][i], rows[1][j] = rows[1][j], rows[1][i]
        elif how == "gpus swapped":
            rows[1][0], rows[1][1] = rows[1][1], rows[1][0]
        elif how == "gpu and switch swapped":  # a switch id where a GPU belongs, a GPU where a switch does
            i, j = rows[1].index("n1-pcie-switch-0"), next(k for k, v in enumerate(rows[1]) if isinstance(v, int))
            rows[1][i], rows[1][j] = rows[1][j], rows[1][i]
        elif how == "shared id":  # node 1 "owns" node 0's CPU: its links would carry two nodes' load
            rows[1][-1] = rows[0][-1]
        else:
            del rows[1]
        return d
    return edit


@pytest.mark.parametrize("how", ["switches swapped", "gpus swapped", "gpu and switch swapped", "shared id",
                                 "node missing"])
def test_composed_entry_node_structure_is_checked(disk, how):
    """The entry keeps the node structure (each node's ids) so a load skips the per-node isomorphism
    test; an edited structure (with a consistent checksum) is caught, ignored and rewritten."""
    plans, calls = disk
    p = jax_blink.plan(TOPO, "allreduce", algorithm="trees")
    (path,) = _entry(plans)
    good = path.read_bytes()
    _rewrite(path, edit_plan=_restructure(how))
    jax_blink.clear_caches()
    assert jax_blink.plan(TOPO, "allreduce", algorithm="trees") == p and len(calls) == 2
    assert path.read_bytes() == good


def test_composed_entry_without_structure_computes_it(disk):
    """An entry without the stored structure (ids JSON cannot carry) is checked on the computed one."""
    plans, calls = disk
    p = jax_blink.plan(TOPO, "allreduce", algorithm="rsag")
    (path,) = _entry(plans)
    _rewrite(path, edit_plan=lambda d: {**d, "composed": {**d["composed"], "spec": {
        **d["composed"]["spec"], "structure": None}}})
    jax_blink.clear_caches()
    assert jax_blink.plan(TOPO, "allreduce", algorithm="rsag") == p and len(calls) == 1


def _scale_weights(d, k, rate=None, bound=None):
    for t in d["trees"]:
        t["weight_gbps"] *= k
    d["rate_gbps"] = sum(t["weight_gbps"] for t in d["trees"]) if rate is None else rate
    if bound is not None:
        d["bound_gbps"] = bound
    return d


EDITS = {  # each with its SHA-256 recomputed: only re-certification catches it
    "rate NaN": lambda d: {**d, "rate_gbps": float("nan")},
    "bound NaN": lambda d: {**d, "bound_gbps": float("nan")},
    "weight inf": lambda d: _scale_weights(d, float("inf")),
    "weight 0": lambda d: {**d, "trees": [{**d["trees"][0], "weight_gbps": 0.0}, *d["trees"][1:]],
                           "rate_gbps": sum(t["weight_gbps"] for t in d["trees"][1:])},
    "half rate": lambda d: _scale_weights(d, 0.5),                   # a valid packing, slower
    "half rate and bound": lambda d: _scale_weights(d, 0.5, bound=d["bound_gbps"] / 2),
    "rate above bound": lambda d: {**d, "bound_gbps": d["rate_gbps"] / 2},
}


@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("collective", ["broadcast", "allgather"])
def test_edited_entries_with_a_valid_checksum_are_recertified(disk, edit, collective):
    """An edit whose SHA-256 is recomputed passes the envelope: the recomputed checks (finite weights,
    rate the sum of weights and <= the bound, the bound the recomputed max-flow / cut certificate, the
    rate-optimal request's rate that certificate) refuse it; the entry is planned again and rewritten."""
    plans, calls = disk
    topo = jax_blink.load_topology("dgx1v")
    root = 0 if collective == "broadcast" else None
    p = jax_blink.plan(topo, collective, root=root)
    (path,) = _entry(plans)
    good = path.read_bytes()
    _rewrite(path, edit_plan=EDITS[edit])
    jax_blink.clear_caches()
    q = jax_blink.plan(topo, collective, root=root)
    assert len(calls) == 2 and q == p and q.rate_gbps == pytest.approx(p.bound_gbps, rel=1e-6)
    assert path.read_bytes() == good


def test_capacity_change_is_caught():
    """A plan checked against the same machine with every link at half its bandwidth (an entry whose
    topology's links changed): the capacity check refuses it, naming a link."""
    topo = jax_blink.load_topology("dgx1v")
    p = jax_blink.plan(topo, "broadcast", root=0)
    d = topo.to_dict()
    for link in d["links"]:
        link["bandwidth_gbps"] /= 2
    with pytest.raises(jax_blink.PlanError, match="loads link"):
        store.check_plan(p, jax_blink.Topology.from_dict(d), "broadcast", p.devices)


@pytest.mark.parametrize("kind", ["fifo", "dev zero link", "directory", "oversized"])
def test_special_and_oversized_entries_are_never_read(disk, kind, monkeypatch):
    """A FIFO (would block a plain read), a link to /dev/zero (endless), a directory, or a file over
    MAX_ENTRY_BYTES in an entry's place: not read, planned again (no hang: the test has a timeout)."""
    import os
    import threading
    plans, calls = disk
    p = jax_blink.plan(jax_blink.load_topology("dgx1v"), "broadcast", root=0)
    (path,) = _entry(plans)
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev zero link":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    else:
        monkeypatch.setattr(store, "MAX_ENTRY_BYTES", 1024)
        path.write_bytes(b"{" + b" " * 4096)
    with pytest.raises(ValueError, match="not a regular file|limit"):
        store._read_entry(path)                          # returns at once: O_NONBLOCK, fstat
    jax_blink.clear_caches()
    out = []
    t = threading.Thread(target=lambda: out.append(jax_blink.plan(jax_blink.load_topology("dgx1v"), "broadcast",
                                                                  root=0)), daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), f"plan() hung on a {kind} cache entry"
    assert out == [p] and len(calls) == 2
    if kind in ("fifo", "dev zero link"):                # rewritten over it (not over a directory)
        assert store._read_entry(path).startswith(b'{"key"')
