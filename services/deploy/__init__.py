"""Running a topology: `pdserve up/down/status` (launcher), the topology schema, processes, engine ranks in one container, the demo."""
