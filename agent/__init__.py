"""Host agent: watchers, policy engine, control-socket client, metrics and the turboctl CLI."""
