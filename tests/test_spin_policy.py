"""The spin governor without a loop: preemption from stolen CPU time, misses in a row,
and the back-off that doubles while the probe after a quiet period fails."""

from __future__ import annotations

from aiordma.spin_policy import LONG_PREEMPTION_S, MISS_LIMIT, SpinGovernor


def governor(cpu: list[float]) -> SpinGovernor:
    g = SpinGovernor()
    g.thread_time = lambda: cpu[0]
    return g


def test_a_spin_that_got_its_cpu_is_not_preempted() -> None:
    cpu = [0.0]
    g = governor(cpu)
    g.start(0.0)
    for i in range(1, 101):  # 100 ticks of 1 ms, every one of them on the CPU
        cpu[0] = i * 1e-3
        assert not g.preempted(i * 1e-3)


def test_stolen_time_above_the_share_is_preemption() -> None:
    cpu = [0.0]
    g = governor(cpu)
    g.start(0.0)
    cpu[0] = 1e-3  # 1 ms on the CPU out of 3 ms: 2 ms waited for a core
    assert g.preempted(3e-3)


def test_a_short_stolen_blip_is_below_the_minimum() -> None:
    cpu = [0.0]
    g = governor(cpu)
    g.start(0.0)
    cpu[0] = 0.8e-3  # 0.2 ms stolen of 1 ms: over the share, under the minimum
    assert not g.preempted(1e-3)


def test_short_preemptions_however_many_are_not_preemption() -> None:
    """The kernel's own work on the core (a Soft-RoCE worker delivering the very
    completion the spin waits for) takes it away briefly and often: 300 ticks of
    300 us, 60 us of each off the core (a 20 % share, 18 ms in all) never count."""
    cpu = [0.0]
    g = governor(cpu)
    g.start(0.0)
    for i in range(1, 301):
        cpu[0] += 240e-6
        assert not g.preempted(i * 300e-6), i


def test_long_preemptions_among_short_ones_still_count() -> None:
    """A wait as long as a scheduler slice counts whatever surrounds it: short waits
    around it neither add to it nor hide it."""
    cpu = [0.0]
    g = governor(cpu)
    g.start(0.0)
    now = 0.0
    for _ in range(10):  # short ones: nothing
        now += 300e-6
        cpu[0] += 240e-6
        assert not g.preempted(now)
    long_wait = LONG_PREEMPTION_S + 50e-6
    now += 240e-6 + long_wait
    cpu[0] += 240e-6
    assert not g.preempted(now)  # one, under the minimum of stolen time
    now += 240e-6 + long_wait
    cpu[0] += 240e-6
    assert g.preempted(now)  # a second: over the minimum, and the share


def test_misses_in_a_row_go_quiet_and_a_hit_resets_them() -> None:
    g = SpinGovernor()
    for i in range(MISS_LIMIT - 1):
        g.missed(float(i))
    g.hit()
    for i in range(MISS_LIMIT - 1):
        g.missed(10.0 + i)
    assert g.quiet_periods == 0 and g.quiet_until == float("-inf")
    g.missed(20.0)
    assert g.quiet_periods == 1 and g.quiet_until > 20.0
    # the probe after the quiet period decides: one more miss goes quiet again
    g.missed(g.quiet_until + 1e-4)
    assert g.quiet_periods == 2


def test_back_off_doubles_while_the_probe_fails_and_resets_later() -> None:
    g = SpinGovernor()
    g.go_quiet(0.0)
    first = g.backoff
    g.go_quiet(g.quiet_until + first / 2)  # soon after the end: the probe failed
    assert g.backoff == 2 * first
    for _ in range(20):  # bounded: capped, never grows without limit
        g.go_quiet(g.quiet_until)
    assert g.backoff == 0.5
    g.go_quiet(g.quiet_until + 10.0)  # long after: from the minimum again
    assert g.backoff == first
