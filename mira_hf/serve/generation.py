"""The one generation config every request is decoded with: the model's own, greedy, less the fields continuous
batching does not apply.

transformers' continuous batching builds its logits processors from this config and keeps only those it vouches for:
it drops the ones it marks unsupported (repetition penalties, minimum lengths) and runs the ones it has not
classified (n-gram bans, bad words, suppressed or forced tokens, ...) on the step's tokens of the whole batch, not on
each request's own sequence. `model.generate` applies every one of them to its sequence. So the server clears those
fields and says so when it starts: what it runs is then what it states, the tokens of `generate` with those fields
unset.
"""

from __future__ import annotations

import copy

# Generation-config fields whose logits processors continuous batching does not apply per request -> the values that
# add no processor (besides None: unset, the default from transformers 5 on)
UNAPPLIED_FIELDS: dict[str, tuple] = {
    "repetition_penalty": (1.0,),
    "encoder_repetition_penalty": (1.0,),
    "no_repeat_ngram_size": (0,),
    "encoder_no_repeat_ngram_size": (0,),
    "bad_words_ids": (),
    "sequence_bias": (),
    "min_length": (0,),
    "min_new_tokens": (0,),
    "forced_bos_token_id": (),
    "forced_eos_token_id": (),
    "suppress_tokens": (),
    "begin_suppress_tokens": (),
    "exponential_decay_length_penalty": (),
    "remove_invalid_values": (False,),
    "guidance_scale": (1.0,),
    "watermarking_config": (),
}


def greedy_generation_config(model, max_new_tokens: int):
    """(the model's generation config with the server's one decoding setting: greedy, `max_new_tokens` unless a
    request sets its own, and the `UNAPPLIED_FIELDS` it sets cleared; {field: the value cleared}). The model's own
    config is left as it is."""
    gen = copy.deepcopy(model.generation_config)
    gen.do_sample = False
    gen.temperature = gen.top_p = gen.top_k = None
    gen.num_beams = 1
    gen.max_new_tokens = max_new_tokens
    gen.use_cache = False  # the batching manager keeps its own paged cache
    cleared = {}
    for name, neutral in UNAPPLIED_FIELDS.items():
        value = getattr(gen, name, None)
        if value is not None and value not in neutral:
            cleared[name] = value
            setattr(gen, name, None)
    return gen, cleared


def unapplied_warning(cleared: dict) -> str:
    """What the server tells at start about the generation-config fields it cleared (`greedy_generation_config`)."""
    settings = ", ".join(f"{name}={value!r}" for name, value in cleared.items())
    unset = "; ".join(f"model.generation_config.{name} = None" for name in cleared)
    return (
        f"this model's generation config sets {settings}, which transformers' continuous batching does not apply per "
        "request (it drops those logits processors, or runs them on the batch's tokens rather than each request's): the "
        "server decodes without them, so each answer is the tokens model.generate(ids, do_sample=False) gives with them "
        "unset. "
        f"model.generate applies them; the server cannot. To serve without this warning, unset them before building "
        f"the server ({unset}), or remove them from the checkpoint's generation_config.json."
    )
