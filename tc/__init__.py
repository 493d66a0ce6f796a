"""HTB tree model and its pyroute2 apply/reconcile/remove; network-namespace sandboxes."""
