"""python -m ray_job {train,tune,prepare-data,scale,bench} ...

    python -m ray_job train --data synthetic --num-workers 2 --epochs 2
"""

import sys

from .commands import main

sys.exit(main())
