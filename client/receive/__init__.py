"""How the client receives a tensor stream: Arrow IPC read in place into final buffers,
digests checked, resumed on a break; the bounded window for one-at-a-time loading. Private."""
