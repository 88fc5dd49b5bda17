import os, sys, time, json, torch, transformers
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mira_hf import MiraConfig, MiraMoEModel
from mira_hf.config import QuantConfig
torch.backends.cuda.enable_cudnn_sdp(False)
out = sys.argv[1]
res = {}
cfg = transformers.MixtralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
    num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000)
torch.manual_seed(0)
with torch.device("cuda"):
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
res["impl"] = str(getattr(model.config, "_experts_implementation", None))
ids = torch.randint(0, 32000, (1, 512), device="cuda")
def run(m):
    with torch.no_grad():
        lg = m(input_ids=ids).logits
        lg1 = m(input_ids=ids[:, :1]).logits
    tok = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    return lg, lg1, tok
ref = run(model)
for name, kw in [("raw", dict(quantization=None)), ("lossless-packed", dict(quantization="lossless", quant=QuantConfig(placement="packed"))),
                 ("lossless-dequant", dict(quantization="lossless", quant=QuantConfig(placement="dequant")))]:
    t = time.time()
    try:
        w = MiraMoEModel.wrap(model, MiraConfig(gpu_budget=0.5, **kw))
        got = run(w)
        res[name] = dict(prefill_equal=bool(torch.equal(ref[0], got[0])), prefill_maxdiff=float((ref[0].float()-got[0].float()).abs().max()),
            one_equal=bool(torch.equal(ref[1], got[1])), one_maxdiff=float((ref[1].float()-got[1].float()).abs().max()),
            tokens_equal=bool(torch.equal(ref[2], got[2])), s=time.time()-t)
        model = w.unload() if hasattr(w, "unload") else w
    except Exception as e:
        import traceback; res[name] = dict(error=traceback.format_exc()[-1500:])
    print(name, res[name], flush=True)
json.dump(res, open(os.path.join(out, "diag.json"), "w"), indent=1)
