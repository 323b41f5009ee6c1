"""StallWatch: a step whose host time is far above the running mean is logged with where
its time went (garbage collection timed by a gc callback); the device's time never is."""

from __future__ import annotations

import gc
import logging

from strata.engine.stalls import StallWatch, gc_clock


def test_a_host_stall_is_logged_and_device_time_is_not(caplog):
    watch = StallWatch()
    now = 100.0
    watch.idle(now)
    for _ in range(50):  # steady 1 ms steps, half of it waiting for the device
        now += 0.001
        watch.committed(now, launch=0.0002, wait=0.0005)
    with caplog.at_level(logging.WARNING, logger="strata.engine"):
        now += 2.0
        watch.committed(now, launch=0.0002, wait=1.9995)  # a long prompt: the device's
        assert watch.stalls == 0 and not caplog.records
        now += 0.4
        watch.committed(now, launch=0.3, wait=0.0005)  # a 0.3 s launch: a compile, say
    assert watch.stalls == 1
    message = caplog.records[-1].getMessage()
    assert "a slow step: 400 ms on the host" in message and "launching windows 300 ms" in message


def test_the_collector_is_timed():
    clock = gc_clock()
    assert gc_clock() is clock
    before = clock.seconds[2]
    junk = [[i] for i in range(200_000)]
    gc.collect()
    del junk
    assert clock.seconds[2] > before


def test_cpu_stages_compute_is_never_counted_as_host_time(tiny_models):
    """On the CPU a stage computes in the engine's own launch. With windows built ahead the
    window launched in a step is not the one it collects, and the compute subtracted from
    the step must be the launched one's: a step's host time is never negative, so the
    running mean that stalls are judged by stays a host time."""
    from strata.config import EngineConfig
    from strata.engine.engine import Engine
    from strata.sampling.params import SamplingParams
    from test_pipeline import repetitive_prompts

    engine = Engine(EngineConfig(model=str(tiny_models["llama"][0]), parallel=4, spec=8,
                                 schedule_ahead="on"))
    watch, hosts = engine.stalls, []
    committed = watch.committed

    def spied(now, launch, wait):
        if watch._last is not None:
            hosts.append(now - watch._last - wait)
        committed(now, launch, wait)

    watch.committed = spied
    engine.generate(repetitive_prompts(320), SamplingParams(temperature=0, max_tokens=40,
                                                            ignore_eos=True))
    assert len(hosts) > 20 and min(hosts) >= 0, sorted(hosts)[:3]
    assert engine.stalls._mean > 0


def test_a_collection_inside_a_launch_or_a_wait_counts_once(tiny_models, caplog):
    """The collector runs where Python allocates, inside a launch or the wait for the
    device too: its time is told apart from both, so launching, collecting and the rest of
    a slow step add up to its host time (no negative rest)."""
    import re

    from strata.config import EngineConfig
    from strata.engine.engine import Engine
    from strata.sampling.params import SamplingParams

    engine = Engine(EngineConfig(model=str(tiny_models["llama"][0]), parallel=2, spec=0))
    junk = [[i] for i in range(300_000)]  # makes a full collection take tens of ms
    submit, collect, calls = engine.runner.submit, engine.runner.collect, [0]

    def collecting(method):
        def call(*args):
            calls[0] += 1
            if calls[0] in (30, 45):  # once in a launch, once in a wait, mid-run
                gc.collect()
            return method(*args)
        return call

    engine.runner.submit, engine.runner.collect = collecting(submit), collecting(collect)
    with caplog.at_level(logging.WARNING, logger="strata.engine"):
        engine.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0, max_tokens=30,
                                                              ignore_eos=True))
    slow = [r.getMessage() for r in caplog.records if "a slow step" in r.getMessage()]
    assert slow and len(junk) == 300_000
    for message in slow:
        rest = float(re.search(r"the rest \(committing, the server\) (-?[0-9]+) ms",
                               message).group(1))
        assert rest >= -1, message
