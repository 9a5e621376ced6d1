"""`I/N`: the I-th of N disjoint shares of a job split across processes or machines (`scalevec-data prepare --shard`,
`scalevec-ablate --shard`), I counting from 0 as Slurm array task ids do."""


def parse_shard(text: str, flag: str = "--shard") -> tuple[int, int]:
    """(I, N) from `I/N` with 0 <= I < N; a ValueError naming `flag` otherwise."""
    index, _, count = text.partition("/")
    if not (index.strip().isdigit() and count.strip().isdigit() and int(index) < int(count)):
        raise ValueError(f"{flag} {text!r}: give I/N with 0 <= I < N (I counts from 0, as Slurm array task ids)")
    return int(index), int(count)
