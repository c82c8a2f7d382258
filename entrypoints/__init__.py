"""Process start-up, above every role package: the `tandem` command (`entrypoints.cli`), the
`tandem up` launcher, each role's process entry point, and `entrypoints.cluster`, which starts,
watches and stops a cluster's processes. Nothing below this package imports it."""
