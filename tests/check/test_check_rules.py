"""Rules on small scripts: the guard and call idioms people write, and their near misses."""

from __future__ import annotations

import textwrap

import pytest

from ddpkit.check import check_source

HEAD = "import os\nimport torch\nimport torch.distributed as dist\n"


def codes(source: str, select: str | None = None) -> list[str]:
    text = HEAD + textwrap.dedent(source)
    found = check_source(text, "t.py", select=[select] if select else None)
    return [f.code for f in found]


# -- DDP106: guards spelled the ways people spell them -----------------------------------

HANGS = {
    "attribute and epoch": """
        class T:
            def step(self, epoch):
                if self.gpu_id == 0 and epoch % self.k == 0:
                    dist.barrier()
        """,
    "environment variable": """
        if int(os.environ["RANK"]) == 0:
            dist.barrier()
        """,
    "local rank in -1 or 0": """
        def f(args, t):
            if args.local_rank in [-1, 0]:
                dist.all_reduce(t)
        """,
    "alias of a comparison": """
        def f(t):
            is_main = dist.get_rank() == 0
            if is_main:
                dist.all_reduce(t)
        """,
    "tainted boolean": """
        def f(t, rank, step):
            should_log = rank == 0 and step % 10 == 0
            if should_log:
                dist.all_reduce(t)
        """,
    "helper predicate": """
        def on_rank_zero():
            return dist.get_rank() == 0

        def f(t):
            if on_rank_zero():
                dist.all_reduce(t)
        """,
    "conditional expression": """
        def f(t, rank):
            return dist.all_reduce(t) if rank == 0 else None
        """,
    "short circuit": """
        def f(rank):
            rank == 0 and dist.barrier()
        """,
    "continue in a loop": """
        def f(xs, rank):
            for x in xs:
                if rank != 0:
                    continue
                dist.broadcast(x, src=0)
        """,
    "spawned worker's first parameter": """
        import torch.multiprocessing as mp

        def worker(idx, world_size, t):
            if idx == 0:
                dist.all_gather_object([None] * world_size, t)

        mp.spawn(worker, args=(2, None), nprocs=2)
        """,
    "star import": """
        from torch.distributed import *

        def f(rank):
            if rank == 0:
                barrier()
        """,
    "accelerate style": """
        def f(accelerator, t):
            if accelerator.is_main_process:
                dist.all_reduce(t)
        """,
    "two levels of helpers": """
        def inner(t):
            dist.all_reduce(t)

        def outer(t):
            inner(t)

        def main(rank, t):
            if rank == 0:
                outer(t)
        """,
    "rank above zero": """
        def f(rank, t):
            if rank > 0:
                dist.all_reduce(t)
        """,
    "below two, constant first": """
        def f(rank, t):
            if 2 > rank:
                dist.all_reduce(t)
        """,
    "method called from a guarded branch only": """
        class Trainer:
            def _sync(self):
                dist.barrier()

            def train(self):
                if self.rank == 0:
                    self._sync()
        """,
    # Rank 0 makes two barriers and the others one: counted per path, they differ.
    "method called on every rank and once more on rank 0": """
        class Trainer:
            def _sync(self):
                dist.barrier()

            def train(self):
                if self.rank == 0:
                    self._sync()
                self._sync()
        """,
}


@pytest.mark.parametrize("source", HANGS.values(), ids=list(HANGS))
def test_ddp106_finds_collectives_behind_rank_checks(source: str) -> None:
    assert codes(source, "DDP106") == ["DDP106"]


SAFE = {
    "distributed-mode check": """
        def f(local_rank):
            if local_rank != -1:
                dist.barrier()
        """,
    "set-up checks that hold alike on every rank": """
        def f(local_rank, t):
            if local_rank < 0:
                return t
            if local_rank >= 0 and -1 < local_rank:
                dist.barrier()
            if 0 <= local_rank:
                dist.all_reduce(t)
        """,
    "rank is None": """
        def f(rank):
            if rank is None:
                dist.barrier()
        """,
    "world size": """
        def f(world_size, t):
            if world_size > 1:
                dist.all_reduce(t)
        """,
    "both branches": """
        def f(rank, t):
            if rank == 0:
                dist.broadcast(t, 0)
            else:
                dist.broadcast(t, 0)
        """,
    "not resolvable to torch.distributed": """
        from functools import reduce

        def f(rank, xs):
            if rank == 0:
                print(reduce(lambda a, b: a + b, xs), torch.gather(xs, 0, xs))
        """,
    "never called here (a library function)": """
        def sync():
            dist.barrier()
        """,
    "subgroup": """
        def f(rank, t, members, group):
            if rank in members:
                dist.all_reduce(t, group=group)
        """,
}


@pytest.mark.parametrize("source", SAFE.values(), ids=list(SAFE))
def test_ddp106_stays_silent_when_every_rank_gets_there(source: str) -> None:
    assert codes(source, "DDP106") == []


SEVERITY = {
    # A rank by data flow: torch's own call, the launcher's variable, mp.spawn's index.
    "get_rank()": ("if dist.get_rank() == 0:", "error"),
    "LOCAL_RANK": ('if int(os.environ["LOCAL_RANK"]) == 0:', "error"),
    "a variable given to init_process_group": ("if rank == 0:", "error"),
    # A rank only by its name: nothing in sight shows where `is_master` comes from.
    "a name alone": ("if is_master:", "warning"),
}


@pytest.mark.parametrize(("test", "severity"), SEVERITY.values(), ids=list(SEVERITY))
def test_ddp106_is_an_error_only_when_the_test_is_a_rank_by_data_flow(
    test: str, severity: str
) -> None:
    source = f"""
        def f(t, rank, is_master):
            dist.init_process_group("gloo", rank=rank, world_size=2)
            {test}
                dist.all_reduce(t)
    """
    found = check_source(HEAD + textwrap.dedent(source), "t.py", select=["DDP106"])
    assert [f.severity.value for f in found] == [severity]


# -- DDP103 -----------------------------------------------------------------------------

INIT = 'dist.init_process_group("gloo")\n'


def test_ddp103_needs_a_process_group() -> None:
    body = """
        for epoch in range(3):
            torch.save({}, "ckpt.pt")
        """
    assert codes(INIT + textwrap.dedent(body), "DDP103") == ["DDP103"]
    assert codes(body, "DDP103") == []


@pytest.mark.parametrize(
    "source",
    [
        # nanoGPT style: a boolean alias of the rank check.
        """
        ddp_rank = int(os.environ["RANK"])
        master_process = ddp_rank == 0
        if master_process:
            torch.save({}, "ckpt.pt")
        """,
        # A rank check by early exit: every rank but 0 returns before the save.
        """
        def save(state):
            if dist.get_rank() != 0:
                return
            torch.save(state, "ckpt.pt")

        save({})
        """,
        # Spawned workers init the group; the parent saves their results.
        """
        import torch.multiprocessing as mp

        def worker(rank):
            dist.init_process_group("gloo", rank=rank, world_size=2)
            dist.destroy_process_group()

        def launch():
            mp.spawn(worker, nprocs=2)
            torch.save({}, "results.pt")

        if __name__ == "__main__":
            launch()
            torch.save({}, "also_parent.pt")
        """,
        # One file per rank.
        """
        torch.save({}, f"ckpt_{dist.get_rank()}.pt")
        """,
        """
        def dump(preds, rank):
            path = os.path.join("preds", f"part_{rank}.pt")
            torch.save(preds, path)

        dump([], dist.get_rank())
        """,
        # Only ever called from somewhere we cannot see.
        """
        def export(model):
            torch.save(model.state_dict(), "model.pt")
        """,
    ],
)
def test_ddp103_silent_on_guarded_or_per_rank_saves(source: str) -> None:
    assert codes(INIT + textwrap.dedent(source), "DDP103") == []


# -- DDP104 -----------------------------------------------------------------------------


def test_ddp104_follows_reassignment() -> None:
    wrong = """
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(torch.nn.Linear(1, 1))
        torch.save(model.state_dict(), "a.pt")
        """
    right = """
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(torch.nn.Linear(1, 1))
        model = model.module
        torch.save(model.state_dict(), "a.pt")
        """
    assert codes(wrong, "DDP104") == ["DDP104"]
    assert codes(right, "DDP104") == []


# -- DDP101, DDP102 ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sampler", "expected"),
    [
        ("DistributedSampler(ds)", ["DDP101"]),
        ("DistributedSampler(ds, shuffle=True)", ["DDP101"]),
        ("DistributedSampler(ds, shuffle=False)", []),
        ("DistributedSampler(ds, None, None, False)", []),
        ("DistributedSampler(ds, shuffle=args.shuffle)", []),
    ],
)
def test_ddp101_only_for_shuffling_samplers(sampler: str, expected: list[str]) -> None:
    source = f"""
        from torch.utils.data import DataLoader, DistributedSampler
        def train(ds, args, step):
            loader = DataLoader(ds, batch_size=8, sampler={sampler})
            for epoch in range(3):
                for batch in loader:
                    step(batch)
        """
    assert codes(source, "DDP101") == expected


@pytest.mark.parametrize(
    ("loader", "expected"),
    [
        ("DataLoader(ds, shuffle=True, batch_sampler=bs)", ["DDP102"]),
        ("DataLoader(ds, shuffle=True, sampler=None)", []),
        ("DataLoader(ds, shuffle=is_train, sampler=s)", []),
        ("DataLoader(ds, shuffle=False, sampler=s)", []),
    ],
)
def test_ddp102(loader: str, expected: list[str]) -> None:
    source = f"""
        from torch.utils.data import DataLoader
        def build(ds, bs, s, is_train):
            return {loader}
        """
    assert codes(source, "DDP102") == expected


# -- DDP105, DDP107, DDP108 -------------------------------------------------------------


def test_ddp105_torchvision_model_and_norm_layer() -> None:
    resnet = """
        import torchvision
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(torchvision.models.resnet50())
        """
    norm_layer = """
        from torch import nn
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(Net(norm_layer=nn.BatchNorm2d))
        """
    no_ddp = """
        from torch import nn
        model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        """
    assert codes(resnet, "DDP105") == ["DDP105"]
    assert codes(norm_layer, "DDP105") == ["DDP105"]
    assert codes(no_ddp, "DDP105") == []


def test_ddp107_only_in_ddp_scripts_and_ddp108_everywhere() -> None:
    plain = 'state = torch.load("a.pt")\n'
    assert codes(plain, "DDP107") == []
    assert codes(INIT + plain, "DDP107") == ["DDP107"]
    unsafe = (
        'from torch import load\nstate = load("a.pt", map_location="cpu", weights_only=False)\n'
    )
    assert codes(unsafe, "DDP108") == ["DDP108"]


# -- DDP109, DDP110, DDP111 -------------------------------------------------------------


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ('dist.init_process_group("cpu:gloo,cuda:nccl")', ["DDP109"]),
        ("dist.init_process_group(dist.Backend.NCCL)", ["DDP109"]),
        ("dist.init_process_group(backend)", []),  # a parameter: could be anything
        ('dist.init_process_group("gloo")', []),
        (
            'with torch.cuda.device(rank):\n        dist.init_process_group("nccl")',
            [],
        ),
        (
            'os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)\n    dist.init_process_group("nccl")',
            [],
        ),
    ],
)
def test_ddp109(setup: str, expected: list[str]) -> None:
    source = f"def setup(rank, backend, model):\n    {setup}\n    return model.cuda()\n"
    assert codes(source, "DDP109") == expected


def test_ddp109_backend_read_from_a_config_is_a_warning_that_says_so() -> None:
    source = HEAD + (
        "def run(rank, cfg):\n"
        '    dist.init_process_group(backend=cfg["backend"], rank=rank, world_size=2)\n'
        "    torch.cuda.empty_cache()\n"
    )
    (finding,) = check_source(source, select=["DDP109"])
    assert finding.severity.value == "warning"
    assert "`cfg['backend']`, read from a config, is nccl" in finding.message


@pytest.mark.parametrize(
    ("use", "expected"),
    [
        ("torch.cuda.synchronize()", ["DDP109"]),
        ("torch.cuda.empty_cache()", ["DDP109"]),
        ("DataLoader(data, batch_size=8, pin_memory=True)", ["DDP109"]),
        ("dist.all_gather_object(out, data)", ["DDP109"]),
        ('torch.zeros(2, device="cuda")', ["DDP109"]),
        ('data.to(torch.device("cuda"))', ["DDP109"]),
        # The rank's GPU named explicitly: the current device is never used.
        ("torch.cuda.synchronize(rank)", []),
        ("data.cuda(rank)", []),
        ("torch.zeros(2, device=rank)", []),
        ("dist.barrier()", []),  # guesses rank % device count: the rank's own GPU here
        # A fixed count of GPUs per node: wrong on smaller nodes.
        ('data.to(f"cuda:{dist.get_rank() % 8}")', ["DDP109"]),
        ('data.to(f"cuda:{dist.get_rank() % torch.cuda.device_count()}")', []),
    ],
)
def test_ddp109_needs_a_use_of_the_current_device(use: str, expected: list[str]) -> None:
    """Without `set_device`, only what works on the current device lands on GPU 0."""
    source = f'def run(rank, data, out):\n    dist.init_process_group("nccl")\n    {use}\n'
    assert codes(source, "DDP109") == expected


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('os.environ.update({"MASTER_PORT": "1234"})', ["DDP110"]),
        ('store = dist.TCPStore("127.0.0.1", 29500, 2, True)', ["DDP110"]),
        (
            'dist.init_process_group("gloo", "tcp://10.0.0.1:23456", rank=0, world_size=1)',
            ["DDP110"],
        ),
        ('os.environ["MASTER_PORT"] = str(free_port())', []),
        ('store = dist.TCPStore("127.0.0.1", 0, 2, True)', []),
        ('dist.init_process_group("gloo", init_method="file:///tmp/rdzv")', []),
    ],
)
def test_ddp110(line: str, expected: list[str]) -> None:
    assert codes(line + "\n", "DDP110") == expected


@pytest.mark.parametrize(
    ("default", "expected"),
    [
        ("tcp://localhost:10001", ["DDP110"]),
        ("tcp://127.0.0.1:10001", ["DDP110"]),
        ("tcp://[::1]:10001", ["DDP110"]),
        ("tcp://:10001", ["DDP110"]),
        # Another machine's address: a placeholder that every run replaces.
        ("tcp://224.66.41.62:23456", []),
        ("tcp://node-0.cluster:23456", []),
    ],
)
def test_ddp110_argparse_default_on_this_machine_only(default: str, expected: list[str]) -> None:
    source = f"""
        def main(parser):
            parser.add_argument("--dist-url", default="{default}")
            args = parser.parse_args()
            dist.init_process_group("gloo", init_method=args.dist_url)
        """
    assert codes(source, "DDP110") == expected


def test_ddp111_accepts_atexit_and_finally() -> None:
    atexit = (
        "import atexit\n"
        'dist.init_process_group("gloo")\n'
        "atexit.register(dist.destroy_process_group)\n"
    )
    missing = 'dist.init_process_group("gloo")\n'
    assert codes(atexit, "DDP111") == []
    assert codes(missing, "DDP111") == ["DDP111"]


# -- noqa -------------------------------------------------------------------------------


def test_noqa_silences_the_named_code_only() -> None:
    base = INIT + "dist.destroy_process_group()\n"
    save = 'torch.save({}, "a.pt")'
    assert codes(base + save + "\n") == ["DDP103"]
    assert codes(base + save + "  # noqa: DDP103\n") == []
    assert codes(base + save + "  # noqa: DDP106, DDP110\n") == ["DDP103"]
    assert codes(base + save + "  # noqa\n") == []
