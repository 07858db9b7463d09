"""Resilient groups' machinery: who is in the world, who failed, who waits to join, and the
epoch the survivors agree on. Private: import each name from the module that defines it.

``policy`` (whether resilience is on, and its settings), ``writes`` (the two ways a member
writes the world's keys), ``state`` (a process's view of the membership), ``death_log``
(reading the world's event log), ``liveness`` (wills, heartbeats, the monitor thread),
``cleanup`` (what the members no longer need), ``agreement`` (shrink, grow, enter),
``joining`` (a new process asks in), ``guarded_store`` (a group's store that gives up on a
dead member) and ``membership`` (the class that ties them).
"""
