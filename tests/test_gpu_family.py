"""tandem_kernels.gpu_family: the one rule by which the kernels' tables and the benchmarks' ceilings are
read for a GPU's product name."""
from tandem_kernels.gpu_family import family_entry, family_of

TABLE = {"H100": "hopper-80", "H200": "hopper-141", "A100": "ampere"}


def test_a_family_is_a_substring_of_the_product_name() -> None:
    assert family_of("NVIDIA H100 80GB HBM3", TABLE) == "H100"
    assert family_of("NVIDIA H200", TABLE) == "H200"
    assert family_entry(TABLE, "NVIDIA A100-SXM4-80GB", "none") == "ampere"


def test_an_unknown_or_missing_name_reads_the_default() -> None:
    assert family_of("NVIDIA GeForce RTX 4090", TABLE) is None
    assert family_entry(TABLE, "NVIDIA GeForce RTX 4090", "none") == "none"
    assert family_entry(TABLE, None, 7) == 7
    assert family_entry(TABLE, "", 7) == 7


def test_the_first_family_in_the_table_wins_where_two_match() -> None:
    assert family_entry({"H100": 1, "H100 NVL": 2}, "NVIDIA H100 NVL", 0) == 1
    assert family_entry({"H100 NVL": 2, "H100": 1}, "NVIDIA H100 NVL", 0) == 2


def test_the_kernels_tables_and_the_benchmarks_ceilings_read_the_same_rule() -> None:
    from bench import throughput_gpu
    from tandem_kernels import gemv_tilings as gt

    h100 = "NVIDIA H100 80GB HBM3"
    assert gt.device_tilings(h100) == gt.DEVICE_TILINGS["H100"]
    assert gt.device_tilings("NVIDIA GeForce RTX 4090") == {}
    assert throughput_gpu.run_ceilings_for(None, h100)["copy_GBps"] == throughput_gpu.KNOWN_CEILINGS["H100"]["copy_GBps"]
