"""The experiment verbs: plan's table, bench, sweep, compare, report."""
