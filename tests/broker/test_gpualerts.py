"""The GPU alert rules of PROTOCOL.md section 3 (v3), one test per rule and per edge of it."""
from __future__ import annotations

import time

from broker.run.gpualerts import MAX_GPUS_PER_RANK, GpuAlert, GpuAlertRules
from rank_agent.protocol import GpuSample, ResourceSample


def gpu(index: int = 0, **health) -> GpuSample:
    return GpuSample(device_index=index, name="NVIDIA H100", **health)


def feed(rules: GpuAlertRules, rank: int, *gpus: GpuSample) -> list[GpuAlert]:
    return list(rules.feed(rank, ResourceSample(gpus=list(gpus))))


def kinds(alerts: list[GpuAlert]) -> list[str]:
    return [a.kind for a in alerts]


def test_a_healthy_gpu_and_an_old_agent_raise_nothing():
    rules = GpuAlertRules()
    healthy = gpu(throttle_reasons=[], ecc_uncorrected=0, remapped_rows_pending=False,
                  remapped_rows_failed=False, pcie_link_width=16, pcie_link_width_max=16, nvlink_errors=7)
    for _ in range(3):
        assert feed(rules, 0, healthy) == []
        assert feed(rules, 1, gpu()) == []  # v2 agent: no health fields
    assert rules.feed(2, ResourceSample()) == []


def test_xid_raises_at_once_naming_codes_and_gpu():
    rules = GpuAlertRules()
    assert feed(rules, 5, gpu(3, xid_errors=[79, 48])) == [GpuAlert("gpu_xid", 5, "XID 79, 48 on GPU 3")]
    assert feed(rules, 5, gpu(3)) == []
    feed(rules, 5, gpu(3, xid_errors=[13]))
    assert rules.xids == {5: {3: [3, 13]}}  # tallied for /metrics: events seen, latest code


def test_throttle_needs_two_consecutive_samples():
    rules = GpuAlertRules()
    hot = gpu(throttle_reasons=["hw_thermal"], sm_clock_mhz=1005.0)
    assert feed(rules, 0, hot) == []
    (alert,) = feed(rules, 0, hot)
    assert alert == GpuAlert("gpu_throttle", 0, "hw_thermal throttling on GPU 0 (SM 1005 MHz)")
    assert kinds(feed(rules, 0, hot)) == ["gpu_throttle"]  # still throttling: raised again
    # a clear sample breaks the chain
    assert feed(rules, 0, gpu(throttle_reasons=[])) == []
    assert feed(rules, 0, hot) == []
    # different bad reasons in the two samples still count: each sample has one
    assert kinds(feed(rules, 0, gpu(throttle_reasons=["sw_power_cap", "hw_slowdown"]))) == ["gpu_throttle"]


def test_sw_power_cap_alone_is_quiet():
    rules = GpuAlertRules()
    capped = gpu(throttle_reasons=["sw_power_cap"])
    for _ in range(5):
        assert feed(rules, 0, capped) == []
    assert feed(rules, 0, gpu(throttle_reasons=["sw_thermal"])) == []  # previous had only the cap
    assert kinds(feed(rules, 0, gpu(throttle_reasons=["sw_thermal", "sw_power_cap"]))) == ["gpu_throttle"]


def test_each_bad_reason_counts():
    for reason in ("hw_slowdown", "hw_thermal", "hw_power_brake", "sw_thermal"):
        rules = GpuAlertRules()
        feed(rules, 0, gpu(throttle_reasons=[reason]))
        assert kinds(feed(rules, 0, gpu(throttle_reasons=[reason]))) == ["gpu_throttle"], reason


def test_ecc_above_zero_in_the_first_sample_then_on_increase_only():
    rules = GpuAlertRules()
    (alert,) = feed(rules, 2, gpu(1, ecc_uncorrected=2))
    assert alert == GpuAlert("gpu_ecc", 2, "2 uncorrected ECC errors on GPU 1")
    assert feed(rules, 2, gpu(1, ecc_uncorrected=2)) == []
    assert kinds(feed(rules, 2, gpu(1, ecc_uncorrected=3))) == ["gpu_ecc"]
    assert feed(rules, 2, gpu(1, ecc_uncorrected=0)) == []  # a reset volatile counter: no news
    assert kinds(feed(rules, 2, gpu(1, ecc_uncorrected=1))) == ["gpu_ecc"]
    other = GpuAlertRules()
    assert feed(other, 0, gpu(ecc_uncorrected=0)) == []  # a first sample at 0 is healthy


def test_row_remap_pending_or_failed():
    rules = GpuAlertRules()
    assert feed(rules, 0, gpu(remapped_rows_pending=False, remapped_rows_failed=False)) == []
    assert feed(rules, 0, gpu(remapped_rows_pending=True, remapped_rows_failed=False)) == [
        GpuAlert("gpu_row_remap", 0, "row remapping pending on GPU 0")]
    assert feed(rules, 0, gpu(remapped_rows_pending=True, remapped_rows_failed=True)) == [
        GpuAlert("gpu_row_remap", 0, "row remapping failed on GPU 0")]


def test_pcie_width_below_max_in_two_consecutive_samples():
    rules = GpuAlertRules()
    narrow = gpu(pcie_link_width=8, pcie_link_width_max=16, pcie_link_gen=4, pcie_link_gen_max=5)
    assert feed(rules, 0, narrow) == []
    assert feed(rules, 0, narrow) == [GpuAlert("gpu_pcie", 0, "PCIe link x8 of x16 on GPU 0, gen 4 of 5")]
    assert feed(rules, 0, gpu(pcie_link_width=16, pcie_link_width_max=16)) == []
    assert feed(rules, 0, narrow) == []
    # a lower generation alone (links drop to gen 1 when idle to save power) is not news
    idle = gpu(pcie_link_width=16, pcie_link_width_max=16, pcie_link_gen=1, pcie_link_gen_max=5)
    assert feed(rules, 0, idle) == [] and feed(rules, 0, idle) == []
    # width without its max says nothing
    assert feed(rules, 0, gpu(pcie_link_width=8)) == [] and feed(rules, 0, gpu(pcie_link_width=8)) == []


def test_nvlink_on_increase_and_never_on_a_first_sample():
    rules = GpuAlertRules()
    assert feed(rules, 0, gpu(nvlink_errors=40)) == []
    assert feed(rules, 0, gpu(nvlink_errors=40)) == []
    assert feed(rules, 0, gpu(nvlink_errors=52)) == [
        GpuAlert("gpu_nvlink", 0, "12 new NVLink errors (total 52) on GPU 0")]
    assert feed(rules, 0, gpu(nvlink_errors=52)) == []


def test_state_is_per_rank_and_per_gpu():
    rules = GpuAlertRules()
    hot = {"throttle_reasons": ["hw_slowdown"]}
    feed(rules, 0, gpu(0, **hot), gpu(1))
    feed(rules, 1, gpu(0, **hot))
    # rank 0 GPU 1 was not hot before; rank 0 GPU 0 and rank 1 GPU 0 were
    assert feed(rules, 0, gpu(0, **hot), gpu(1, **hot)) == [
        GpuAlert("gpu_throttle", 0, "hw_slowdown throttling on GPU 0")]
    assert kinds(feed(rules, 1, gpu(0, **hot))) == ["gpu_throttle"]
    assert kinds(feed(rules, 0, gpu(0, nvlink_errors=1), gpu(1, xid_errors=[13], ecc_uncorrected=1))) == [
        "gpu_xid", "gpu_ecc"]


def test_one_sample_can_raise_several_kinds():
    rules = GpuAlertRules()
    bad = gpu(xid_errors=[94], throttle_reasons=["hw_power_brake"], ecc_uncorrected=1,
              remapped_rows_failed=True, pcie_link_width=4, pcie_link_width_max=16, nvlink_errors=0)
    assert kinds(feed(rules, 0, bad)) == ["gpu_xid", "gpu_ecc", "gpu_row_remap"]
    worse = gpu(xid_errors=[94], throttle_reasons=["hw_power_brake"], ecc_uncorrected=2,
                remapped_rows_failed=True, pcie_link_width=4, pcie_link_width_max=16, nvlink_errors=3)
    assert kinds(feed(rules, 0, worse)) == ["gpu_xid", "gpu_throttle", "gpu_ecc", "gpu_row_remap",
                                            "gpu_pcie", "gpu_nvlink"]


def test_state_is_bounded_and_forgotten():
    rules = GpuAlertRules()
    for i in range(MAX_GPUS_PER_RANK * 3):
        feed(rules, 0, gpu(i, nvlink_errors=0))
    assert len(rules) == MAX_GPUS_PER_RANK
    feed(rules, 3, gpu(0, nvlink_errors=1))
    feed(rules, 7, gpu(0, nvlink_errors=0))
    rules.forget_from(4)
    assert len(rules) == MAX_GPUS_PER_RANK + 1
    assert feed(rules, 3, gpu(0, nvlink_errors=5)) != []  # rank 3 kept its previous sample
    feed(rules, 9, gpu(0, xid_errors=[79]))
    rules.forget_from(9)
    assert rules.xids == {}
    rules.forget(3)
    assert feed(rules, 3, gpu(0, nvlink_errors=9)) == []  # forgotten: a first sample again


def test_a_quiet_sample_costs_little():
    rules = GpuAlertRules()
    sample = ResourceSample(gpus=[gpu(throttle_reasons=["sw_power_cap"], ecc_uncorrected=0,
                                      remapped_rows_pending=False, remapped_rows_failed=False,
                                      pcie_link_width=16, pcie_link_width_max=16, nvlink_errors=0)])
    rules.feed(0, sample)
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        rules.feed(0, sample)
    per = (time.perf_counter() - t0) / n
    assert per < 20e-6  # generous for a shared 2-core VM; measured ~1 us


def test_a_gpu_without_health_fields_is_not_remembered():
    """Issue 33: a GPU that sets no field the rules read costs one check and is not kept;
    its GPU's older sample is forgotten (as the previous sample it is the same as none)."""
    rules = GpuAlertRules()
    for rank in range(8):
        for _ in range(3):
            assert feed(rules, rank, gpu(0, util_percent=90.0), gpu(1, sm_clock_mhz=1400.0,
                                                                     pcie_link_width_max=16)) == []
    assert len(rules) == 0
    feed(rules, 0, gpu(0, nvlink_errors=3), gpu(1, nvlink_errors=3))
    assert len(rules) == 2
    feed(rules, 0, gpu(0))
    assert len(rules) == 1
    assert feed(rules, 0, gpu(0, nvlink_errors=9), gpu(1, nvlink_errors=9)) == [
        GpuAlert("gpu_nvlink", 0, "6 new NVLink errors (total 9) on GPU 1")]


def _reference(samples: list[tuple[int, GpuSample]]) -> list[tuple[str, int, int]]:
    """The contract's rules (PROTOCOL 3) over every sample of each GPU, the health-less ones
    too, kept whole: (kind, rank, device index) of each alert, in order."""
    prev: dict[tuple[int, int], GpuSample] = {}
    out = []

    def throttled(g: GpuSample) -> bool:
        return bool(set(g.throttle_reasons) - {"sw_power_cap"})

    def narrow(g: GpuSample) -> bool:
        return (g.pcie_link_width is not None and g.pcie_link_width_max is not None
                and g.pcie_link_width < g.pcie_link_width_max)

    for rank, g in samples:
        p = prev.get((rank, g.device_index))
        kinds = []
        if g.xid_errors:
            kinds.append("gpu_xid")
        if p is not None and throttled(g) and throttled(p):
            kinds.append("gpu_throttle")
        if g.ecc_uncorrected is not None:
            before = None if p is None else p.ecc_uncorrected
            if (before is None and g.ecc_uncorrected > 0) or (
                    before is not None and g.ecc_uncorrected > before):
                kinds.append("gpu_ecc")
        if g.remapped_rows_failed or g.remapped_rows_pending:
            kinds.append("gpu_row_remap")
        if p is not None and narrow(g) and narrow(p):
            kinds.append("gpu_pcie")
        if (g.nvlink_errors is not None and p is not None and p.nvlink_errors is not None
                and g.nvlink_errors > p.nvlink_errors):
            kinds.append("gpu_nvlink")
        out += [(k, rank, g.device_index) for k in kinds]
        prev[(rank, g.device_index)] = g
    return out


def test_the_rules_are_the_contracts_with_health_less_samples_between():
    """Randomized: samples with and without health fields mixed on the same GPUs raise what
    the contract's rules raise over every sample kept whole (the reference above)."""
    import random

    rnd = random.Random(33)
    samples = []
    for _ in range(3000):
        rank, index = rnd.randrange(3), rnd.randrange(2)
        if rnd.random() < 0.5:
            g = gpu(index, util_percent=50.0, sm_clock_mhz=rnd.choice([None, 1400.0]),
                    pcie_link_width_max=rnd.choice([None, 16]))
        else:
            g = gpu(index, xid_errors=[79] if rnd.random() < 0.05 else [],
                    ecc_uncorrected=rnd.choice([None, 0, 1, 2, 3]),
                    throttle_reasons=rnd.choice([[], ["hw_slowdown"], ["sw_power_cap"]]),
                    pcie_link_width=rnd.choice([None, 16, 8]),
                    pcie_link_width_max=rnd.choice([None, 16]),
                    nvlink_errors=rnd.choice([None, 0, 1, 5]),
                    remapped_rows_pending=rnd.choice([None, False, False, True]))
        samples.append((rank, g))
    rules = GpuAlertRules()
    got = [(a.kind, a.rank, int(a.message.split("GPU ")[1].split()[0]))
           for rank, g in samples for a in feed(rules, rank, g)]
    expected = _reference(samples)
    assert got == expected
    assert len({k for k, _, _ in expected}) == 6  # every rule fired


def test_feed_many_is_feed_one_by_one():
    """A batch's samples fed in one call (``feed_many``, the broker's held samples) raise
    what feeding them one by one raises, in the same order, and leave the same state."""
    import random

    from broker.run.gpualerts import Sampled

    rnd = random.Random(7)

    def sample() -> ResourceSample:
        gpus = []
        for index in rnd.sample(range(4), rnd.randint(0, 3)):
            gpus.append(gpu(index, xid_errors=[79] if rnd.random() < 0.1 else [],
                            ecc_uncorrected=rnd.choice([None, 0, 0, 1, 2]),
                            throttle_reasons=rnd.choice([[], [], ["hw_slowdown"],
                                                         ["sw_power_cap"]]),
                            pcie_link_width=rnd.choice([None, 16, 8]), pcie_link_width_max=16,
                            nvlink_errors=rnd.choice([None, 0, 1, 5]),
                            remapped_rows_pending=rnd.random() < 0.05))
        return ResourceSample(gpus=gpus)

    items = [Sampled(rnd.randrange(6), sample()) for _ in range(400)]
    one, many = GpuAlertRules(), GpuAlertRules()
    expected = [a for item in items for a in one.feed(item.rank, item.sample)]
    got = []
    for i in range(0, len(items), 37):  # batches of uneven size
        got += many.feed_many(items[i:i + 37])
    assert got == expected
    assert len(expected) > 50 and len(set(kinds(expected))) == 6  # every rule fired
    assert many._prev == one._prev and many.xids == one.xids
