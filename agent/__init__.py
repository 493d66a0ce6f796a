"""Host agent: watchers, degradation policy, actuator (worker throttle, relax ceil), status socket, metrics."""
