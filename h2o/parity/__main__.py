"""``python -m h2o.parity`` (``make parity``): the driver, :func:`h2o.parity.driver.main`."""
import sys

from h2o.parity.driver import main

sys.exit(main())
