"""A single-process, nanochat-style loop: model + optimizer + meta through the manager,
a resume, then a model-only load (on the meta device) for inference.

    python examples/nanochat_style.py [CKPT_DIR]
"""

import sys
import tempfile

import torch

import shardpoint as sp
from shardpoint.api import state as sps

VOCAB, DIM, SEQ = 64, 32, 16


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Linear(4 * DIM, DIM)
        )
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        return self.head(self.mlp(self.emb(idx)))


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, VOCAB, (8, SEQ), generator=g)
    return x, (x * 7 + 3) % VOCAB


def train(mgr, until, meta):
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = 0
    if mgr.latest_step() is not None:  # resume
        like = {
            "model": sps.model_state(model),
            "optim": sps.optimizer_state(model, opt),
            "meta": meta,
        }  # same structure: values come back loaded
        out = mgr.load(like=like)
        sps.set_optimizer_state(model, opt, out["optim"])
        step = out["meta"]["step"]
        assert out["meta"]["config"] == meta["config"]
        print(f"resumed at step {step}")
    while step < until:
        step += 1
        x, y = batch(step)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")
        if step % 2 == 0:
            mgr.save(
                step,
                {
                    "model": sps.model_state(model),
                    "optim": sps.optimizer_state(model, opt),
                    "meta": {**meta, "step": step},
                },
                metrics={"loss": loss.item()},
            )
    return model


def main(root):
    meta = {"config": {"vocab": VOCAB, "dim": DIM}, "step": 0}
    with sp.CheckpointManager(root, max_to_keep=2, best_metric="loss") as mgr:
        train(mgr, 4, meta)  # a first run stops at step 4
        trained = train(mgr, 8, meta)  # a second one resumes to 8
        assert mgr.all_steps() == [6, 8] or mgr.best_step() in mgr.all_steps()
        # inference: build on meta (no memory, no init), materialize from the checkpoint;
        # only the model's bytes are read, never the optimizer's
        with torch.device("meta"):
            infer = TinyLM()
        rep = sp.LoadReport()
        sps.load_model(mgr.path(mgr.latest_step()), infer, report=rep)
        nbytes = sum(t.numel() * t.element_size() for t in infer.state_dict().values())
        assert rep.rank_bytes_read == nbytes
        for n, t in trained.state_dict().items():
            assert torch.equal(t, infer.state_dict()[n]), n
        idx = torch.tensor([[5]])
        with torch.no_grad():
            for _ in range(5):
                idx = torch.cat([idx, infer(idx)[:, -1:].argmax(-1)], 1)
        print("generated:", idx.tolist()[0], "read", nbytes, "bytes for inference")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="nanochat-ckpt-"))
