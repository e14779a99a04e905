"""CPU: time one `QEDModel.generate` call on 16 MK-NIAH prompts of 1K tokens (8 new tokens each).

    python bench/cpu_generate.py THREADS
"""
import time, sys, torch
from qedprobe.model import QEDModel
from qedprobe.eval.tasks import NIAHTask
torch.set_num_threads(int(sys.argv[1]))
p='checkpoints/interference-full-s0'
m=QEDModel.from_pretrained(p,dtype=torch.float32).eval()
t=NIAHTask("mk-niah",p,num_needles=8,haystack="noise")
xs=[t.sample(1024,i,samples=16,seed=0).input_ids for i in range(16)]
t0=time.time()
with torch.no_grad(): m.generate(xs, 8)
print(f"threads {sys.argv[1]}: 16 prompts of 1K in one generate call: {time.time()-t0:.1f} s")
