"""Same-host memory: what ranks on one host share without a socket. Anonymous shared-memory
segments and the transport's arenas (shm.py), shared windows (window.py), cross-memory
attach (samehost/cma.py), each rank's single-writer mailbox slots (mailbox.py, its C core in
_mailbox_core.pyx; named.py's in _named_core.pyx; _spin.h: what both wait with), and which of
them an allreduce reads (samehost/planes.py). The lane that moves small operations through the
mailboxes is lane/, one level up."""
