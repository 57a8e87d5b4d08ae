"""The jail for model-written code: which jail this machine gives and its verdicts (`sandbox`), one
run (`bwrap`), the system calls it refuses (`seccomp_filter`), its cgroup (`cgroups`), its first
process (`launcher`), user namespaces (`userns`), and the harness that runs verl's code tests inside
it (`code_harness`)."""
