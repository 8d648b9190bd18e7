"""One condition: Cubit fwd+bwd T=256 and softmax/performer decode step, median ms."""
import json, os, statistics, sys, time
import torch
from kernelmix import ops
from kernelmix.model import CausalLM, ModelConfig
from kernelmix.generate import generate
if sys.argv[1] == "auto":
    from kernelmix.threads import set_threads
    set_threads(None); threads = "auto=%d" % torch.get_num_threads()
else:
    threads = int(sys.argv[1]); torch.set_num_threads(threads)
torch.manual_seed(0)
B, T, H, d = 2, 256, 4, 32
q, k, v, r = (torch.randn(B, T, H, d, requires_grad=True) for _ in range(4))
rho = torch.rand(B, T, H) + 0.5
def timeit(fn, n=7):
    fn(); ts = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3
res = {}
res["cubit_fb_ms"] = timeit(lambda: ops.cubit_attention(q, k, v, r, rho=rho).sum().backward())
res["softmax_fb_ms"] = timeit(lambda: ops.softmax_attention(q, k, v).sum().backward())
for mixer in ("softmax", "performer"):
    m = CausalLM(ModelConfig.preset("tiny", mixer=mixer)).eval()
    p = torch.randint(0, m.config.vocab_size, (1, 32))
    res[f"{mixer}_decode_ms_per_token"] = timeit(lambda: generate(m, p, 64, temperature=0.0), n=3) / 64
print(json.dumps({"threads": threads, "omp_wait": os.environ.get("OMP_WAIT_POLICY", "-"), **{k: round(v, 3) for k, v in res.items()}}))
