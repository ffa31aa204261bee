"""The commit mechanism registry: one list of names, one class per name in each backend family, resolved once."""
from __future__ import annotations

import argparse

import pytest

from qwen36.generation.sampling import DRAFT_MODES
from qwen36.speculative.mechanisms import DEFAULT_MECHANISM, MECHANISMS, check_mechanism
from qwen36.speculative.reference_mechanisms import REFERENCE_MECHANISMS, ReferenceMechanism, reference_mechanism
from qwen36.generation.sampling import SamplingParams
from qwen36.tt.spec.mechanisms import TT_MECHANISMS, GDNStateBytes, TTMechanism, tt_mechanism


@pytest.mark.parametrize("family", [REFERENCE_MECHANISMS, TT_MECHANISMS], ids=["reference", "tt"])
def test_each_family_implements_every_name_once(family):
    assert tuple(family) == MECHANISMS
    for name, cls in family.items():
        assert cls.name == name
    assert DEFAULT_MECHANISM in MECHANISMS


def test_names_resolve_once_and_bad_input_is_refused():
    for name in MECHANISMS:
        assert isinstance(reference_mechanism(name), REFERENCE_MECHANISMS[name])
        assert isinstance(tt_mechanism(name), TT_MECHANISMS[name])
    built = TT_MECHANISMS["snapshot"]()
    assert tt_mechanism(built) is built  # an object passes through (tests inject broken subclasses)
    with pytest.raises(ValueError, match="unknown commit mechanism 'ring'; choose from"):
        tt_mechanism("ring")
    with pytest.raises(ValueError, match="unknown commit mechanism"):
        check_mechanism("Snapshot")
    with pytest.raises(TypeError, match="not a commit mechanism of this backend"):
        tt_mechanism(REFERENCE_MECHANISMS["snapshot"]())  # the reference family's object on the TT backend
    assert issubclass(REFERENCE_MECHANISMS["recompute"], ReferenceMechanism)
    assert issubclass(TT_MECHANISMS["recompute"], TTMechanism)


def test_cli_choices_come_from_the_registry():
    from qwen36.commands.generate import add_spec_args

    p = argparse.ArgumentParser()
    add_spec_args(p)
    actions = {a.dest: a for a in p._actions}
    assert tuple(actions["commit"].choices) == MECHANISMS and actions["commit"].default == DEFAULT_MECHANISM
    assert tuple(actions["draft"].choices) == DRAFT_MODES and actions["draft"].default == "sample"


def test_sampled_drafts_is_the_one_draft_mode_decision():
    assert SamplingParams(temperature=1.0).sampled_drafts
    assert not SamplingParams(temperature=1.0, draft="greedy").sampled_drafts
    assert not SamplingParams().sampled_drafts  # greedy runs draft by argmax whatever the draft mode
    with pytest.raises(ValueError, match="draft must be 'sample' or 'greedy'"):
        SamplingParams(temperature=1.0, draft="top")


def test_tt_closed_form_counters():
    """Fixed device shapes: nothing depends on a; the figures the TP probe and the docs quote."""
    n, b = 3, GDNStateBytes(recurrent=1000, conv=24)
    k, t = 3, 4
    got = {m: TT_MECHANISMS[m]().expected_step_counters(k, 1, n, b) for m in MECHANISMS}
    assert got["shadow_commit"] == {"steps": 1, "aborts": 0, "target_forwards": 1, "mtp_forwards": k,
                                    "state_copies": 0, "state_bytes_moved": 0,
                                    "slot_bytes_written": t * 1024, "recurrence_steps": t * n}
    assert (got["snapshot"]["state_copies"], got["snapshot"]["state_bytes_moved"]) == (2 * n, 2 * 1024)
    assert (got["recompute"]["state_copies"], got["recompute"]["state_bytes_moved"]) == (n, 1000)
    assert got["snapshot"]["recurrence_steps"] == got["recompute"]["recurrence_steps"] == 2 * t * n
    for m in MECHANISMS:
        assert got[m] == TT_MECHANISMS[m]().expected_step_counters(k, k, n, b)  # independent of a
