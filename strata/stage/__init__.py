"""Stages execute windows: a Stage is a layer range on one device with one cache per layer;
the last stage's WindowVerifier verifies and runs the MTP drafter; the Runner protocol is
how the engine drives stages, and ModelRunner runs them in this process (stage processes
are in strata/pipeline/)."""
