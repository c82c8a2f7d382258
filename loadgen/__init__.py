"""The load generator behind `tandem bench`: datasets, an SDK-driven load run and its report
(ARCHITECTURE.md lists the modules; `loadgen.command.main` is the command).

Torch-free and below the entry points, so the `tandem` command and the benchmark scripts in
`bench/` (which start clusters through `entrypoints.cluster`) can both use it.
"""
