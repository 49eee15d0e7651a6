"""GPU health on the page (contract v3, PROTOCOL sections 2-4), through the real stack: a
real broker raises the GPU alerts from the health fields real frames carry, the web serves
them and Chromium renders them. The rank table shows each rank's health as tags with
explaining titles and sorts by it, the per-rank picture (GPU tiles for a small run, the
heatmap for a big one) can be coloured by health, the alert list names the GPU and the code
with a what-to-do hint, and a hostile GPU name stays text. A screenshot of the rank table
is left in artifacts/gpu-health-table.png."""
from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect

from rank_agent import protocol as wire
from tests.support.browser import ARTIFACTS, HOSTILE, Stack, register
from tests.support.polling import wait_for as wait_until

pytestmark = pytest.mark.browser

GIB = 2**30


def gpu_sample(rank: int, index: int, name: str = "NVIDIA H100 80GB HBM3", **health: Any) -> wire.ResourceSample:
    """A sample of one rank's GPU: healthy (at its power cap, PCIe x16 of x16, no errors)
    unless ``health`` says otherwise."""
    fields: dict[str, Any] = dict(
        sm_clock_mhz=1980.0, throttle_reasons=["sw_power_cap"], xid_errors=[], ecc_uncorrected=0,
        remapped_rows_pending=False, remapped_rows_failed=False, pcie_link_gen=5,
        pcie_link_gen_max=5, pcie_link_width=16, pcie_link_width_max=16, nvlink_errors=0)
    fields.update(health)
    return wire.ResourceSample(
        cpu_percent=30.0, ram_used_bytes=100 * GIB, ram_total_bytes=512 * GIB,
        gpu_util_percent=90.0, vram_allocated_bytes=60 * GIB, vram_total_bytes=80 * GIB,
        gpus=[wire.GpuSample(device_index=index, name=name, util_percent=90.0,
                             vram_allocated_bytes=60 * GIB, vram_total_bytes=80 * GIB,
                             temperature_c=64.0, power_w=690.0, **fields)])


def send(stack: Stack, run: str, rank: int, sample: wire.ResourceSample) -> None:
    stack.send(wire.Resources(run=run, rank=rank, sample=sample))


def alert_kinds(stack: Stack, run: str) -> set:
    """(kind, rank) of the run's alerts; the run must exist (a 404's HTTPError would leave
    its socket to the garbage collector)."""
    return {(a["kind"], a["rank"]) for a in stack.get_json(f"/api/runs/{run}")["alerts"]}


def tag(page: Any, rank: int, key: str) -> Any:
    return page.locator(f'#rank-table tr[data-rank="{rank}"] .health-tag[data-tag="{key}"]')


def test_rank_table_tags_alerts_and_health_tiles(stack: Stack, page: Any) -> None:
    run = "gpu-health-small"
    register(stack, run, 4, 0, hosts=["node-a"], per_host=4)
    bad = dict(ecc_uncorrected=3, remapped_rows_pending=True, pcie_link_width=8, nvlink_errors=0)
    for _ in range(2):  # two samples each: the two-sample rules (throttle, PCIe) fire
        send(stack, run, 0, gpu_sample(0, 0))
        send(stack, run, 1, gpu_sample(1, 1, throttle_reasons=["sw_power_cap", "hw_thermal"],
                                       sm_clock_mhz=1410.0))
        send(stack, run, 2, gpu_sample(2, 2))
        send(stack, run, 3, gpu_sample(3, 3, name=HOSTILE, **bad))
    stack.wait_run(run)
    wait_until(lambda: {("gpu_throttle", 1), ("gpu_ecc", 3), ("gpu_pcie", 3),
                        ("gpu_row_remap", 3)} <= alert_kinds(stack, run), 15.0, "the broker's GPU alerts")

    page.goto(f"{stack.url}/#run={run}")
    expect(page.locator("#run-picker")).to_have_value(run)
    # the column appears once ranks report health; rank 0 at its power cap is quietly ok
    expect(page.locator('#rank-table th [data-sort="health"]')).to_have_text("GPU health")
    ok = page.locator('#rank-table tr[data-rank="0"] .health-tag')
    expect(ok).to_have_text(["ok"], timeout=10_000)
    expect(ok).to_have_class("health-tag health-ok")
    expect(ok).to_have_attribute("title", "GPU healthy: no XID, ECC, row remap, throttling, PCIe or NVLink "
                                          "trouble (at its power cap: normal at full load)")
    therm = tag(page, 1, "throttle-hw_thermal")
    expect(therm).to_have_text("THERM")
    expect(therm).to_have_class("health-tag health-warn")
    assert "hardware thermal slowdown" in (therm.get_attribute("title") or "")
    assert "SM clock 1,410 MHz" in (therm.get_attribute("title") or "")
    expect(page.locator('#rank-table tr[data-rank="3"] .health-tag')).to_have_text(
        ["ECC 3", "REMAP", "PCIe x8/16"])
    expect(tag(page, 3, "ecc")).to_have_class("health-tag health-bad")
    expect(tag(page, 3, "pcie")).to_have_class("health-tag health-warn")
    # the hostile GPU name reaches the page only as text (a title)
    assert HOSTILE in (tag(page, 3, "ecc").get_attribute("title") or "")

    # live: an XID on rank 2, NVLink errors growing on rank 3
    send(stack, run, 2, gpu_sample(2, 2, xid_errors=[79]))
    send(stack, run, 3, gpu_sample(3, 3, name=HOSTILE, **dict(bad, nvlink_errors=12)))
    xid = tag(page, 2, "xid")
    expect(xid).to_have_text("XID 79", timeout=10_000)
    expect(xid).to_have_class("health-tag health-bad")
    assert "XID catalogue" in (xid.get_attribute("title") or "")
    expect(tag(page, 3, "nvlink")).to_have_text("NVL 12")
    # the next sample has no XID (an XID is an event): the rank's alert keeps the tag
    send(stack, run, 2, gpu_sample(2, 2))
    wait_until(lambda: not [r for r in stack.get_json(f"/api/runs/{run}")["ranks"]
                            if r["rank"] == 2 and r["resources"]["gpus"][0].get("xid_errors")],
               10.0, "rank 2's next sample without an XID")
    page.wait_for_timeout(1200)  # the page's next ranks event (at most one a second)
    expect(xid).to_have_text("XID 79")
    assert "earlier sample" in (xid.get_attribute("title") or "")

    # the alerts name the GPU and the code, with a what-to-do hint
    alerts = page.locator("#alerts")
    x = alerts.locator('.alert[data-kind="gpu_xid"]')
    expect(x.locator(".alert-kind")).to_have_text("GPU XID")
    expect(x.locator(".alert-msg")).to_have_text("XID 79 on GPU 2")
    assert "XID catalogue" in (x.locator(".alert-kind").get_attribute("title") or "")
    t = alerts.locator('.alert[data-kind="gpu_throttle"]')
    expect(t.locator(".alert-msg")).to_have_text("hw_thermal throttling on GPU 1 (SM 1410 MHz)")
    expect(t).to_have_attribute("data-level", "warn")
    assert "cooling" in (t.get_attribute("title") or "")
    expect(alerts.locator('.alert[data-kind="gpu_pcie"] .alert-msg')).to_have_text(
        "PCIe link x8 of x16 on GPU 3, gen 5 of 5")
    expect(alerts.locator('.alert[data-kind="gpu_nvlink"] .alert-msg')).to_have_text(
        "12 new NVLink errors (total 12) on GPU 3")
    expect(alerts.locator('.alert[data-kind="gpu_ecc"] .alert-kind')).to_have_text("GPU ECC")

    # sort by health: the worst rank first (3: ECC, remap, PCIe, NVLink), the healthy last
    page.locator('#rank-table [data-sort="health"]').click()
    order = page.locator("#rank-table tbody tr")
    expect(order).to_have_count(4)
    wait_until(lambda: [r.get_attribute("data-rank") for r in order.all()] == ["3", "2", "1", "0"],
               5.0, "ranks sorted worst health first")

    ARTIFACTS.mkdir(exist_ok=True)
    page.locator("#ranks-card").screenshot(path=str(ARTIFACTS / "gpu-health-table.png"))

    # the small run's per-rank picture (GPU tiles) coloured by health
    choice = page.locator('#gpu-minis [data-testid="colour-by"]')
    expect(choice).to_be_visible()
    choice.locator('button[data-colour="health"]').click()
    grid = page.locator("#gpu-minis .gpu-grid")
    expect(grid).to_have_attribute("data-colour", "health")
    for rank, level in ((0, "ok"), (1, "warn"), (2, "bad"), (3, "bad")):
        expect(grid.locator(f'.gpu-tile[data-rank="{rank}"]')).to_have_attribute("data-health", level)
    expect(grid.locator('.gpu-tile[data-rank="1"] .gpu-tile-val')).to_have_text("THERM")
    fill = grid.locator('.gpu-tile[data-rank="2"] .gpu-tile-fill')
    assert fill.evaluate("(e) => getComputedStyle(e).backgroundColor") == "rgba(242, 73, 92, 0.5)"
    page.locator("#resources-now").screenshot(path=str(ARTIFACTS / "gpu-health-tiles.png"))

    assert page.evaluate("() => window.__pwned") is None
    assert page.locator("#rank-table img, #alerts img, #gpu-minis img").count() == 0
    page.errors.check()


# exact canvas colours of the health picture (overview.js HEALTH_COLOURS)
COUNT_RGB = """([sel, rgb]) => {
  const c = document.querySelector(sel);
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4) if (d[i] === rgb[0] && d[i + 1] === rgb[1] && d[i + 2] === rgb[2]) n++;
  return n;
}"""
RED, AMBER, GREEN = (242, 73, 92), (255, 152, 48), (63, 138, 79)


def test_big_run_heatmap_coloured_by_health(stack: Stack, page: Any) -> None:
    run = "gpu-health-big"
    world = 40
    register(stack, run, world, 0, hosts=[f"node-{i}" for i in range(5)], per_host=8)
    for _ in range(2):
        for r in range(world):
            if r >= 36:  # no GPU: a CPU-only sample
                stack.send(wire.Resources(run=run, rank=r, sample=wire.ResourceSample(cpu_percent=20.0)))
            elif r == 5:
                send(stack, run, r, gpu_sample(r, r % 8, xid_errors=[48]))
            elif r in (6, 7, 8, 9):
                send(stack, run, r, gpu_sample(r, r % 8, throttle_reasons=["hw_power_brake"]))
            else:
                send(stack, run, r, gpu_sample(r, r % 8))
    stack.wait_run(run)
    wait_until(lambda: ("gpu_throttle", 9) in alert_kinds(stack, run), 15.0, "the throttle alerts")

    page.goto(f"{stack.url}/#run={run}")
    expect(page.locator("#heat-card")).to_be_visible(timeout=10_000)
    choice = page.locator('#heat-card [data-testid="colour-by"]')
    expect(choice).to_be_visible()
    canvas = 'canvas[data-chart="rank-heatmap"]'

    def count(rgb: tuple) -> int:
        return int(page.evaluate(COUNT_RGB, [canvas, list(rgb)]))

    assert count(RED) == 0 and count(AMBER) == 0  # coloured by load: no health colours
    choice.locator('button[data-colour="health"]').click()
    expect(choice.locator('button[data-colour="health"]')).to_have_attribute("aria-pressed", "true")
    wait_until(lambda: count(RED) > 0, 5.0, "the health colours drawn")
    red, amber, green = count(RED), count(AMBER), count(GREEN)
    # one XID rank, four throttling, 31 healthy (each colour also has one legend swatch)
    cell = red - 64  # an 8 x 8 legend swatch
    assert cell > 0
    assert amber - 64 == 4 * cell
    assert green - 64 == 31 * cell
    expect(page.locator("#rank-table th [data-sort='health']")).to_be_visible()
    page.locator("#heat-card").screenshot(path=str(ARTIFACTS / "gpu-health-heatmap.png"))
    choice.locator('button[data-colour="load"]').click()
    wait_until(lambda: count(RED) == 0, 5.0, "back to the load colours")
    page.errors.check()
