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
