"""Pool storage backends behind one small interface (:class:`base.Backend`)."""
