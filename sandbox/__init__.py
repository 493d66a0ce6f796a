"""The sandbox node for the demo, the tests and the benchmarks: two network namespaces joined
by veth, the tiered load that drives a worker in them, and the reports of what each tier saw."""
