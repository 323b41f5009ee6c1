"""`--simulate-acceptance P`: every slot drafts --spec tokens every window and accepts each
with probability P, labelled simulated everywhere. A server (of a tiny random model: the
text is meaningless anyway) with P = 1 accepts every draft, with P = 0 none."""

from __future__ import annotations

import openai
import pytest

from server_utils import running_server
from strata.config import EngineConfig
from strata.errors import StrataError


@pytest.mark.parametrize("probability", [1.0, 0.0])
def test_server_accepts_every_draft_or_none(tiny_served_model, tmp_path, probability):
    log = tmp_path / "serve.log"
    with running_server("--model", str(tiny_served_model), "--simulate-acceptance",
                        str(probability), "--spec", "4", "--parallel", "2", log=log) as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "Tell me a story."}],
            temperature=0, max_tokens=30)
    drafts = reply.usage.model_extra["drafts"]
    assert drafts["simulated"] is True
    assert reply.usage.completion_tokens == 30
    assert drafts["drafted"] > 0
    if probability == 1.0:
        assert drafts["accepted"] == drafts["drafted"]
        # 4 drafts + 1 token per window: 30 tokens in far fewer windows than 30
        assert drafts["by_proposer"]["simulated"]["windows"] <= 8
    else:
        assert drafts["accepted"] == 0
    assert "SIMULATED drafts=" in log.read_text()


@pytest.mark.parametrize("kwargs", [dict(simulate_acceptance=1.5), dict(simulate_acceptance=0.5,
                                                                         spec=0)])
def test_bad_simulation_settings(kwargs):
    with pytest.raises(StrataError, match="simulate-acceptance"):
        EngineConfig(**kwargs)
