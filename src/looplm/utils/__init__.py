"""Small facts about the machine the tools read: the CPU (:mod:`~looplm.utils.cpuinfo`) and glibc's allocator
setting for CPU training (:mod:`~looplm.utils.cpu_malloc`)."""
