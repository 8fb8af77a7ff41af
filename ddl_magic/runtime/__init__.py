"""The runtime every rank runs: rendezvous, the TCP ring, the op queue and the timeline recorder."""
