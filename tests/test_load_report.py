"""What a router publishes of its load window: counts packed exactly, pulses and details, their sums over
routers, the publisher's cadence, a late reader, and the bounds."""

import io
import zipfile

import numpy as np
import pytest
import torch

from expertmesh.bench.scale.run import whole_window_bytes
from expertmesh.contracts.count_codec import pack_coactivation, pack_counts, unpack_coactivation, unpack_counts
from expertmesh.contracts.load_report import (
    LoadPulse,
    publish_interval_s,
    stale_routers,
    summed_details,
    summed_pulses,
)
from expertmesh.contracts.load_window import MAX_DOMAINS, LoadSnapshot, LoadWindow
from expertmesh.router.reporting.load_publisher import LoadPublisher
from expertmesh.store import RouterHeartbeat, open_store


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _window(seed: int, layers=(1, 3, 4), experts=8, top_k=2, tokens=50, clock=None) -> LoadWindow:
    """A window that recorded ``tokens`` random tokens per layer, with positions, domains and finished sequences."""
    rng = np.random.default_rng(seed)
    window = LoadWindow(layers, experts, top_k, clock=clock or Clock(), max_context=64, position_bins=4)
    choices = {}
    for layer in layers:
        ids = torch.tensor(np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]))
        choices[layer] = ids.numpy()
        domains = (torch.tensor(rng.integers(-1, 2, tokens)), ("code", "math"))
        window.record(layer, ids, positions=torch.arange(tokens), domains=domains)
    window.record_sequence(layers, np.stack([choices[layer] for layer in layers]), 0, tokens + 5, 7)
    return window


def _assert_same(a: LoadSnapshot, b: LoadSnapshot) -> None:
    for name in ("moe_layers", "num_experts", "top_k", "max_context", "query_length_edges"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("load", "coactivation", "position_load", "relative_load", "experts_per_token"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert sorted(a.domain_load) == sorted(b.domain_load)
    for d in a.domain_load:
        np.testing.assert_array_equal(a.domain_load[d], b.domain_load[d])


# -- count_codec ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, dtype",
    [
        ([0.0, 1.0, 2.0**32 - 1], np.uint32),  # whole counts: uint32, exact to the largest
        ([0.5, 2.0], np.float64),  # a fraction (an expected count) stays float64
        ([-1.0, 2.0], np.float64),
        ([2.0**32, 1.0], np.float64),  # past uint32
        ([np.nan, 1.0], np.float64),
    ],
)
def test_pack_counts_is_exact(values, dtype):
    a = np.array(values)
    packed = pack_counts(a)
    assert packed.dtype == dtype
    np.testing.assert_array_equal(unpack_counts(packed), a)
    assert unpack_counts(packed).dtype == np.float64


def test_pack_counts_of_integers_and_empty():
    assert pack_counts(np.array([3, 4], dtype=np.int64)).dtype == np.uint32
    assert unpack_counts(pack_counts(np.zeros((2, 0)))).shape == (2, 0)


def test_coactivation_upper_triangle_round_trip():
    rng = np.random.default_rng(0)
    upper = np.triu(rng.integers(0, 50, (3, 6, 6)), 1).astype(np.float64)
    c = upper + upper.transpose(0, 2, 1)
    packed = pack_coactivation(c)
    assert list(packed) == ["coactivation_upper"] and packed["coactivation_upper"].shape == (3, 15)
    np.testing.assert_array_equal(unpack_coactivation(packed, 6), c)


@pytest.mark.parametrize("change", ["asymmetric", "diagonal", "fraction"])
def test_coactivation_that_is_not_a_windows_is_stored_whole(change):
    c = np.zeros((2, 4, 4))
    c[0, 1, 2] = c[0, 2, 1] = 3.0
    if change == "asymmetric":
        c[1, 0, 3] = 1.0
    elif change == "diagonal":
        c[1, 2, 2] = 1.0
    else:
        c[0, 1, 2] = c[0, 2, 1] = 0.25
    packed = pack_coactivation(c)
    assert list(packed) == (["coactivation"] if change != "fraction" else ["coactivation_upper"])
    np.testing.assert_array_equal(unpack_coactivation(packed, 4), c)


# -- the snapshot's bytes (the detail) ----------------------------------------------------------------------


def test_snapshot_bytes_round_trip_exactly_and_read_older_routers_windows():
    snap = _window(1).snapshot()
    _assert_same(LoadSnapshot.from_bytes(snap.to_bytes()), snap)
    _assert_same(LoadSnapshot.from_bytes(whole_window_bytes(snap)), snap)
    assert len(snap.to_bytes()) < len(whole_window_bytes(snap))


# -- pulses -----------------------------------------------------------------------------------------------


def test_pulse_round_trip_and_of_a_window():
    window = _window(2)
    pulse = LoadPulse.of(window, 1.0e9)
    np.testing.assert_array_equal(pulse.load, window.snapshot().load)
    back = LoadPulse.from_bytes(pulse.to_bytes())
    assert (back.moe_layers, back.num_experts, back.top_k) == ((1, 3, 4), 8, 2)
    assert (back.written_at, back.window_s) == (1.0e9, 600.0)
    np.testing.assert_array_equal(back.load, pulse.load)


def test_a_record_older_than_two_windows_is_stale_and_left_out_and_an_unstamped_one_never():
    now = 1.0e9
    fresh = LoadPulse((0,), 2, 1, np.array([[1.0, 2.0]]), written_at=now - 1199.0, window_s=600.0)
    gone = LoadPulse((0,), 2, 1, np.array([[50.0, 50.0]]), written_at=now - 1201.0, window_s=600.0)
    unstamped = LoadPulse((0,), 2, 1, np.array([[3.0, 0.0]]))  # a router from before stamps
    pulses = {"fresh": fresh.to_bytes(), "gone": gone.to_bytes(), "old": unstamped.to_bytes(), "bad": b"x"}
    assert stale_routers(pulses, now) == ["gone"]
    assert summed_pulses(pulses, now=now).load.tolist() == [[4.0, 2.0]]
    assert summed_pulses(pulses).load.tolist() == [[54.0, 52.0]]  # no clock: every readable record
    # details carry no stamp: a router's is left out with its stale pulse
    snaps = {"fresh": _window(1).snapshot(), "gone": _window(2).snapshot()}
    details = {r: s.to_bytes() for r, s in snaps.items()}
    _assert_same(summed_details(details, pulses, now=now), snaps["fresh"])


def test_publish_interval_keeps_the_fleet_within_its_budget_and_a_live_record_fresh():
    budget = 512 * 1024
    per_router = 100_000.0  # bytes a publish (DeepSeek-V3: a 38 KB pulse and a 60th of a 3.7 MB detail)
    assert publish_interval_s(10.0, 1, per_router, budget, 600.0) == 10.0
    for routers in (64, 128, 1024):
        interval = publish_interval_s(10.0, routers, per_router, budget, 600.0)
        assert routers * per_router / interval == pytest.approx(budget)  # the fleet writes its budget, no more
    assert publish_interval_s(10.0, 10**5, per_router, budget, 600.0) == 300.0  # half the window at the most
    assert publish_interval_s(10.0, 10**5, per_router, 0, 600.0) == 10.0  # no budget
    assert publish_interval_s(10.0, 0, per_router, budget, 600.0) == 10.0


def _with_broken_coactivation(snap: LoadSnapshot) -> bytes:
    """``snap``'s bytes with its co-activation member replaced by bytes no reader can decode."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(snap.to_bytes())) as src, zipfile.ZipFile(out, "w") as dst:
        for name in src.namelist():
            dst.writestr(name, b"not an array" if name.startswith("coactivation") else src.read(name))
    return out.getvalue()


def test_a_pulse_reader_reads_a_whole_snapshot_without_decoding_its_coactivation():
    snap = _window(3).snapshot()
    broken = _with_broken_coactivation(snap)
    with pytest.raises(ValueError):
        LoadSnapshot.from_bytes(broken)
    np.testing.assert_array_equal(LoadPulse.from_bytes(broken).load, snap.load)  # never touched the member
    np.testing.assert_array_equal(LoadPulse.from_bytes(whole_window_bytes(snap)).load, snap.load)


def test_sums_over_routers_equal_the_sum_of_their_windows():
    windows = [_window(seed) for seed in range(4)]
    snaps = [w.snapshot() for w in windows]
    expected = sum(snaps[1:], snaps[0])
    pulses = {f"r{i}": LoadPulse.of(w, 1.0e9).to_bytes() for i, w in enumerate(windows)}
    np.testing.assert_array_equal(summed_pulses(pulses).load, expected.load)
    _assert_same(summed_details({f"r{i}": s.to_bytes() for i, s in enumerate(snaps)}), expected)
    assert summed_pulses({}) is None and summed_details({}) is None


def test_unreadable_or_other_model_records_are_left_out(caplog):
    good = LoadPulse.of(_window(4), 1.0e9)
    other = LoadPulse((0,), 2, 1, np.ones((1, 2)))
    total = summed_pulses({"a": good.to_bytes(), "b": b"garbage", "c": other.to_bytes(), "d": good.to_bytes()})
    np.testing.assert_array_equal(total.load, 2 * good.load)
    assert "'b'" in caplog.text and "'c'" in caplog.text


def test_a_pulse_of_the_wrong_shape_is_refused():
    pulse = LoadPulse((0, 1), 3, 1, np.ones((2, 2)))
    with pytest.raises(ValueError, match="MoE layers"):
        LoadPulse.from_bytes(pulse.to_bytes())


# -- the publisher and a reader ---------------------------------------------------------------------------


def test_publisher_cadence_and_a_late_reader_converges():
    clock = Clock()
    store = open_store("memory://")
    window = LoadWindow((0, 2), 6, 2, clock=clock, window_s=40, buckets=4)
    publisher = LoadPublisher(store, window, interval_s=3600, detail_every=3)
    rng = np.random.default_rng(5)
    details_at = []
    for n in range(7):
        for layer in (0, 2):
            window.record(layer, torch.tensor(np.stack([rng.choice(6, 2, replace=False) for _ in range(5)])))
        before = store.load_details().get(publisher._id)
        publisher.publish()
        if store.load_details().get(publisher._id) != before:
            details_at.append(n)
        # a reader starting now: the load is current after any publish
        np.testing.assert_array_equal(summed_pulses(store.loads()).load, LoadPulse.of(window, 1.0e9).load)
        clock.now += 7  # buckets age out as time passes: a pulse is the window, not a running total
    assert details_at == [0, 3, 6]
    # the detail is the window as of its last publish; the last publish (a router's stop) makes it current
    publisher.publish(detail=True)
    _assert_same(summed_details(store.load_details()), window.snapshot())


def test_publisher_spaces_its_publishes_by_the_routers_heartbeating_in_the_store():
    store = open_store("memory://")
    window = _window(3)
    publisher = LoadPublisher(store, window, interval_s=10.0, detail_every=4, budget_bytes_s=1000.0)
    publisher.publish()
    per_publish = len(store.loads()[publisher._id]) + len(store.load_details()[publisher._id]) / 4
    assert publisher.next_interval_s() == pytest.approx(max(10.0, per_publish / 1000.0))
    for r in range(40):
        store.publish_router_heartbeat(RouterHeartbeat(f"r{r}", 1, 0.0))
    assert publisher.next_interval_s() == pytest.approx(min(300.0, max(10.0, 40 * per_publish / 1000.0)))
    unbudgeted = LoadPublisher(store, window, interval_s=10.0)
    unbudgeted.publish()
    assert unbudgeted.next_interval_s() == 10.0


def test_publisher_refuses_no_details():
    with pytest.raises(ValueError):
        LoadPublisher(open_store("memory://"), LoadWindow((0,), 2, 1), 1.0, detail_every=0)


# -- bounds -----------------------------------------------------------------------------------------------


def test_published_sizes_are_bounded_by_the_model():
    L, E, k = 58, 256, 8
    rng = np.random.default_rng(6)
    load = rng.integers(0, 1 << 20, (L, E)).astype(np.float64)  # a busy router: 20-bit counts
    assert len(LoadPulse(tuple(range(L)), E, k, load).to_bytes()) <= 4 * L * E + 2048
    # domains: past MAX_DOMAINS a sub-domain counts under its top-level one (a label of the classifier's
    # taxonomy, which requests are checked against), so a detail's domain_load stays bounded
    window = LoadWindow((0,), 4, 1, clock=Clock())
    names = tuple(f"code/{i}" for i in range(MAX_DOMAINS + 10))
    window.record(0, torch.zeros((len(names), 1), dtype=torch.long), domains=(torch.arange(len(names)), names))
    assert len(LoadSnapshot.from_bytes(window.snapshot().to_bytes()).domain_load) == MAX_DOMAINS + 1
