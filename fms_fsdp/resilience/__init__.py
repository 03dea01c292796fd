"""What keeps a run alive and says why it stopped: stop requests and time-based saves agreed by every rank
(triggers.py), one run per folder (lease.py), the slowest rank named (stragglers.py), a hang's dumps and
one line naming who did not arrive (hangs.py), and replica groups that survive a lost node (ft.py,
ft_settings.py: --fault_tolerance with torchft)."""
