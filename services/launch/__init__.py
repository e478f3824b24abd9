"""Running a topology: `pdserve up/down/status` (launcher), the topology schema, processes, the ranks of an
engine in one container, the demo."""
