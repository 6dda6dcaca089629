"""`ddpkit check --explain CODE`: why a rule exists, with a wrong and a right example."""

from __future__ import annotations

from dataclasses import dataclass
from inspect import cleandoc

from ddpkit.check.model import UNREADABLE
from ddpkit.check.rules import RULES_BY_CODE


@dataclass
class Explanation:
    why: str
    wrong: str
    right: str

    def __post_init__(self) -> None:
        # The texts below are indented like the code around them: store them flush left.
        self.why, self.wrong, self.right = map(cleandoc, (self.why, self.wrong, self.right))


EXPLANATIONS: dict[str, Explanation] = {
    "DDP101": Explanation(
        why="""DistributedSampler shuffles with a seed made from `seed + epoch`. The epoch
            stays 0 unless you call `set_epoch`, so every epoch visits the samples in
            the same order, which quietly hurts convergence.""",
        wrong="""
            loader = DataLoader(ds, batch_size=32, sampler=DistributedSampler(ds))
            for epoch in range(epochs):
                for x, y in loader:
                    step(x, y)""",
        right="""
            loader = DataLoader(ds, batch_size=32, sampler=DistributedSampler(ds))
            for epoch in range(epochs):
                loader.sampler.set_epoch(epoch)
                for x, y in loader:
                    step(x, y)""",
    ),
    "DDP102": Explanation(
        why="""A sampler decides the order of the samples, so DataLoader refuses
            `shuffle=True` together with `sampler=` (or `batch_sampler=`) and raises
            ValueError when the job starts. DistributedSampler shuffles by itself.""",
        wrong="DataLoader(ds, batch_size=32, shuffle=True, sampler=DistributedSampler(ds))",
        right="DataLoader(ds, batch_size=32, shuffle=False, sampler=DistributedSampler(ds))",
    ),
    "DDP103": Explanation(
        why="""Every rank runs the same script. A `torch.save` that is not behind a rank-0
            check is run by all of them, and they write the same file at the same time:
            wasted I/O at best, a torn checkpoint at worst. The model is identical on
            all ranks, so rank 0 alone should write it. (A file per rank, named with
            the rank, is fine and not reported.)""",
        wrong="""
            for epoch in range(epochs):
                train_one_epoch()
                torch.save(model.module.state_dict(), "ckpt.pt")""",
        right="""
            for epoch in range(epochs):
                train_one_epoch()
                if rank == 0:
                    torch.save(model.module.state_dict(), "ckpt.pt")
                dist.barrier()  # on every rank, if others read the file next""",
    ),
    "DDP104": Explanation(
        why="""DistributedDataParallel keeps your model as its `.module`, so the wrapper's
            state_dict() names every parameter `module.<name>`. Such a checkpoint does
            not load into the plain model (for evaluation, or a single-GPU run) without
            renaming the keys. Save the inner model's state_dict instead.""",
        wrong="""
            model = DDP(model, device_ids=[rank])
            ...
            torch.save(model.state_dict(), "ckpt.pt")""",
        right="""
            model = DDP(model, device_ids=[rank])
            ...
            torch.save(model.module.state_dict(), "ckpt.pt")""",
    ),
    "DDP105": Explanation(
        why="""Under DDP each rank sees only its share of the batch, and plain BatchNorm
            normalises with that small share's statistics; running stats then differ
            between ranks. SyncBatchNorm computes them over the whole global batch.
            (The DDP tutorial's note: replace every BatchNorm with SyncBatchNorm.)""",
        wrong="""
            model = ResNetWithBatchNorm().to(rank)
            model = DDP(model, device_ids=[rank])""",
        right="""
            model = ResNetWithBatchNorm()
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model).to(rank)
            model = DDP(model, device_ids=[rank])""",
    ),
    "DDP106": Explanation(
        why="""A collective (all_reduce, barrier, broadcast, gather, ...) returns only when
            every rank of the group has called it. Behind a rank check, rank 0 calls it
            and the other ranks never do, so the job hangs until the timeout (the DDP
            tutorial's warning). This includes a helper that makes a collective called on
            rank 0 only, and the forward of a sharded (FSDP) model, which gathers its
            parameters from every rank. It is an error when the rank test is a rank by data
            flow (get_rank(), RANK, what init_process_group is given), a warning when only
            its name says so.""",
        wrong="""
            if rank == 0:
                dist.all_reduce(loss)          # ranks 1..N-1 never arrive
                print(loss.item() / world_size)""",
        right="""
            dist.all_reduce(loss)              # every rank
            if rank == 0:
                print(loss.item() / world_size)  # only the printing is rank-0 work""",
    ),
    "DDP107": Explanation(
        why="""torch.load restores each tensor onto the device it was saved from, which is
            usually cuda:0. Without map_location every rank loads the whole checkpoint
            onto GPU 0, which wastes its memory or runs it out. (A load that only rank 0
            makes is left alone.)""",
        wrong='state = torch.load("ckpt.pt")',
        right='state = torch.load("ckpt.pt", map_location=f"cuda:{local_rank}")  # or "cpu"',
    ),
    "DDP108": Explanation(
        why="""With weights_only=False, torch.load unpickles the file, and a pickle can run
            any code when loaded. A checkpoint from a shared folder or the internet then
            runs code on every rank of your job. The default weights_only=True loads
            tensors, numbers, strings and containers, which is all a checkpoint needs.""",
        wrong='state = torch.load("ckpt.pt", map_location="cpu", weights_only=False)',
        right='state = torch.load("ckpt.pt", map_location="cpu", weights_only=True)',
    ),
    "DDP109": Explanation(
        why="""nccl uses the current CUDA device of each process. Unless every process
            selects its own GPU, all of them use GPU 0: out of memory, or an nccl error
            about duplicate GPUs. Select the device before creating the group.""",
        wrong='dist.init_process_group("nccl", rank=rank, world_size=world_size)',
        right="""
            torch.cuda.set_device(local_rank)
            dist.init_process_group("nccl", rank=rank, world_size=world_size)""",
    ),
    "DDP110": Explanation(
        why="""The rendezvous port is bound by rank 0. A fixed port (the tutorial's 12355)
            works until a second job runs on the same machine, which then fails with
            'address already in use'. Let a launcher pick a free port. Severity: info.""",
        wrong='os.environ["MASTER_PORT"] = "12355"',
        right="""
            # launched with `torchrun --standalone --nproc-per-node=gpu train.py`,
            # which sets MASTER_ADDR/MASTER_PORT to a free port
            dist.init_process_group(backend="nccl")""",
    ),
    "DDP111": Explanation(
        why="""A process group holds sockets, threads and GPU communicators. Without
            destroy_process_group() on the way out, the job can hang or warn at exit
            and a relaunch in the same process fails. Destroy it in `finally` so that
            errors clean up too.""",
        wrong="""
            def main(rank, world_size):
                dist.init_process_group("gloo", rank=rank, world_size=world_size)
                train()""",
        right="""
            def main(rank, world_size):
                dist.init_process_group("gloo", rank=rank, world_size=world_size)
                try:
                    train()
                finally:
                    dist.destroy_process_group()""",
    ),
    "DDP113": Explanation(
        why="""Every rank must make the same collective calls, in the same order. A loop
            that one rank leaves early, on a value only it holds (the KL of its own
            minibatch, rank 0's validation loss, a counter only rank 0 moves), leaves
            the other ranks in the loop, waiting in the next all-reduce or DDP backward
            for a rank that never comes: the job hangs. Make the decision on a value
            every rank agrees on: all-reduce or broadcast it first, then test it.
            Severity: error when the value is surely per-rank (a rank test, or computed
            from this rank's data or model), a warning when the rank is one by its name
            only. DDP112 is `ddpkit run --audit`'s (the ranks trained different weights).""",
        wrong="""
            for epoch in range(epochs):
                train_one_epoch(ddp_model, loader, optimizer)  # backward: all-reduce
                if rank == 0 and validate(ddp_model) > best:
                    break  # ranks 1.. start another epoch and wait""",
        right="""
            for epoch in range(epochs):
                train_one_epoch(ddp_model, loader, optimizer)
                stop = torch.tensor(int(rank == 0 and validate(ddp_model) > best))
                dist.broadcast(stop, src=0)  # every rank now holds rank 0's decision
                if stop.item():
                    break""",
    ),
}

_UNREADABLE_TEXT = (
    f"{UNREADABLE}: file could not be read or parsed\n\n"
    "The file was not checked: it could not be read, or it is not valid Python\n"
    "(the message gives the parser's reason and position). Fix the file and run again;\n"
    "this code cannot be selected, ignored or silenced.\n"
)


def _indent(text: str) -> str:
    return "\n".join("    " + line if line else "" for line in text.splitlines())


def explain(code: str) -> str:
    """The rationale of rule `code` with a wrong and a right example; KeyError if unknown."""
    code = code.strip().upper()
    if code == UNREADABLE:
        return _UNREADABLE_TEXT
    rule = RULES_BY_CODE[code]
    text = EXPLANATIONS[code]
    return (
        f"{rule.code} ({rule.severity.value}): {rule.summary}\n\n"
        f"{text.why}\n\n"
        f"Wrong:\n\n{_indent(text.wrong)}\n\n"
        f"Right:\n\n{_indent(text.right)}\n"
    )
