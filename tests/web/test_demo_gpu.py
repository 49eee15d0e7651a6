"""The demo's simulated GPUs (rankboard.demogpu) through the real sampler and the broker's
real GPU alert rules: one GPU throttles thermally for a while and clears, another reports
XID 79 once, the rest raise nothing, so a demo without a GPU shows every GPU health panel
and alert. No processes: the sample generator is what decides, and it is deterministic."""
from __future__ import annotations

from typing import Any

from broker.run.gpualerts import GpuAlertRules
from rankboard import demogpu
from rankboard.demogpu import SimulatedNvml, roles, simulated_sampler

SAMPLES = demogpu.THROTTLE_TO + 4


def run_samples(rank: int, world: int, local_rank: int) -> tuple[list[Any], list[list[Any]]]:
    """``SAMPLES`` samples of ``rank``'s simulated GPU and the alerts each one raised."""
    sampler = simulated_sampler(rank, world, local_rank, seed="test")
    rules = GpuAlertRules()
    try:
        sampler.hardware_summary()  # the demo calls set_hardware first: not a sample
        samples = [sampler.sample() for _ in range(SAMPLES)]
    finally:
        sampler.close()
    return samples, [list(rules.feed(rank, s)) for s in samples]


def test_roles_put_throttle_and_xid_on_distinct_ranks_when_there_are_enough() -> None:
    assert roles(8) == (1, 2)
    assert roles(4) == (1, 2)
    assert roles(2) == (1, 0)
    assert roles(1) == (0, 0)


def test_roles_sit_on_the_last_host_with_the_slow_rank() -> None:
    """One bad node (issue 37): the throttling GPU, the XID GPU and the demo's slow-input
    last rank all on the last host, so the hosts table has exactly one suspect."""
    from rankboard.demo import layout

    for world, hosts in ((8, 2), (4, 2), (2, 2), (5, 2), (7, 3), (16, 4), (3, 1)):
        where = layout(world, hosts)
        thermal, xid = roles(world, hosts)
        assert where[thermal][0] == where[xid][0] == where[-1][0], (world, hosts)
    assert roles(8, 2) == (5, 6) and roles(4, 2) == (3, 2) and roles(8, 1) == (1, 2)


def test_the_thermal_gpu_throttles_for_a_while_then_clears_and_raises_gpu_throttle() -> None:
    samples, alerts = run_samples(1, 4, 1)
    gpus = [s.gpus[0] for s in samples]
    assert all(g.name == demogpu.NAME and g.device_index == 1 for g in gpus)
    hot = [i + 1 for i, g in enumerate(gpus) if "hw_thermal" in g.throttle_reasons]
    assert hot == list(range(demogpu.THROTTLE_FROM, demogpu.THROTTLE_TO))
    assert all("sw_power_cap" in g.throttle_reasons for g in gpus)  # at full load, quietly
    assert gpus[demogpu.THROTTLE_FROM - 1].sm_clock_mhz < gpus[0].sm_clock_mhz
    assert gpus[demogpu.THROTTLE_FROM - 1].temperature_c == 89
    raised = [i + 1 for i, a in enumerate(alerts) if a]
    # two consecutive samples: the second throttled sample raises, each one after it too
    assert raised == list(range(demogpu.THROTTLE_FROM + 1, demogpu.THROTTLE_TO))
    first = alerts[demogpu.THROTTLE_FROM][0]
    assert first.kind == "gpu_throttle" and first.rank == 1
    assert first.message == "hw_thermal throttling on GPU 1 (SM 1410 MHz)"
    # every other health field reads healthy: no other kind ever
    assert {a.kind for batch in alerts for a in batch} == {"gpu_throttle"}
    assert all(g.xid_errors == [] and g.ecc_uncorrected == 0 and g.pcie_link_width == 16
               and g.pcie_link_width_max == 16 and g.nvlink_errors == 0
               and g.remapped_rows_pending is False for g in gpus)


def test_the_xid_gpu_reports_xid_79_once() -> None:
    samples, alerts = run_samples(2, 4, 0)
    xids = [(i + 1, s.gpus[0].xid_errors) for i, s in enumerate(samples) if s.gpus[0].xid_errors]
    assert xids == [(demogpu.XID_AT, [demogpu.XID_CODE])]
    raised = [(i + 1, [(a.kind, a.message) for a in batch]) for i, batch in enumerate(alerts) if batch]
    assert raised == [(demogpu.XID_AT, [("gpu_xid", "XID 79 on GPU 0")])]


def test_the_other_gpus_raise_nothing() -> None:
    for rank in (0, 3):
        samples, alerts = run_samples(rank, 4, rank % 2)
        assert all(s.gpus and s.gpus[0].util_percent for s in samples)
        assert all(s.vram_total_bytes == 80 * 2**30 for s in samples)
        assert not any(alerts), (rank, alerts)


def test_a_one_rank_demo_has_both_stories_on_its_gpu() -> None:
    samples, alerts = run_samples(0, 1, 0)
    kinds = [a.kind for batch in alerts for a in batch]
    assert "gpu_xid" in kinds and "gpu_throttle" in kinds


def test_the_simulated_nvml_never_waits_and_says_timeout_like_pynvml() -> None:
    nv = SimulatedNvml(0, xid=True)
    events = nv.nvmlEventSetCreate()
    try:
        nv.nvmlEventSetWait(events, 0)
    except nv.NVMLError_Timeout as exc:
        assert exc.value == 10
    else:
        raise AssertionError("no event queued: the wait must time out at once")
