"""A tiny multi-objective reward model with a gating layer, laid out as ArmoRM is (RLHFlow/ArmoRM-Llama3-8B-v0.1):
remote code that a model directory ships beside its weights and names in ``config.json``'s ``auto_map``.

The tiny kit (``rlhf_pipeline.tiny.save_tiny_armo_model``) copies this file into the directory it writes; the
pipeline never imports it. transformers runs it only when asked to (``trust_remote_code=True``): its
``model_type``, ``tiny_armo``, is registered nowhere else, so the configuration class is remote code too.

The model: a Llama body; a regression layer from the last real token's hidden state to ``num_objectives`` rewards;
a gating network over the hidden state of the token that opens the answer (the last ``gating_token_id``, the
assistant role token, where ArmoRM finds the end of the prompt) giving softmax weights over the objectives; and
``score``, shape (B,), the weighted sum of the rewards. Its output has ``rewards``, ``gating_output`` and ``score``
and no ``logits``, so a reader of ``logits`` fails on it. It imports ``LLAMA_INPUTS_DOCSTRING`` as ArmoRM's code
does, a name transformers 5 no longer has (``rlhf_pipeline.compat`` gives it back).
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from transformers import LlamaConfig, LlamaModel, LlamaPreTrainedModel
from transformers.models.llama.modeling_llama import LLAMA_INPUTS_DOCSTRING  # as ArmoRM's code imports it
from transformers.utils import ModelOutput, add_start_docstrings_to_model_forward


class TinyArmoConfig(LlamaConfig):
    """A Llama configuration of its own ``model_type``; ``num_objectives``, ``gating_hidden_dim``,
    ``gating_temperature`` and ``gating_token_id`` are kept as extra attributes."""

    model_type = "tiny_armo"


@dataclass
class TinyArmoOutput(ModelOutput):
    rewards: Optional[torch.FloatTensor] = None  # (B, num_objectives)
    gating_output: Optional[torch.FloatTensor] = None  # (B, num_objectives), each row sums to 1
    score: Optional[torch.FloatTensor] = None  # (B,): sum over objectives of gating_output * rewards


def _last_position(mask: torch.Tensor) -> torch.Tensor:
    """(B,) the last position of each row where ``mask`` (B, T) is true, -1 where it is nowhere."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=1).values


class TinyArmoForRewardModel(LlamaPreTrainedModel):
    config_class = TinyArmoConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaModel(config)
        objectives, width = config.num_objectives, config.gating_hidden_dim
        self.regression_layer = nn.Linear(config.hidden_size, objectives, bias=False)
        self.gating = nn.Sequential(nn.Linear(config.hidden_size, width), nn.ReLU(), nn.Linear(width, objectives))
        self.post_init()

    @add_start_docstrings_to_model_forward(LLAMA_INPUTS_DOCSTRING)
    def forward(self, input_ids=None, attention_mask=None, **kwargs) -> TinyArmoOutput:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        pad = self.config.pad_token_id
        if pad is None:
            last = torch.full_like(rows, input_ids.shape[1] - 1)
        else:
            last = _last_position(input_ids.ne(pad)).clamp(min=0)
        rewards = self.regression_layer(hidden[rows, last])
        gate = _last_position(input_ids.eq(self.config.gating_token_id))
        if bool((gate < 0).any()):
            raise ValueError(f"a sequence without the gating token {self.config.gating_token_id} (the assistant turn)")
        gating_output = torch.softmax(self.gating(hidden[rows, gate]) / self.config.gating_temperature, dim=-1)
        score = (gating_output * rewards).sum(dim=-1)
        return TinyArmoOutput(rewards=rewards, gating_output=gating_output, score=score)
