"""Fake data for the DeepSpeed script corpus (tests/test_ds_corpus.py): loaded at interpreter
start when this folder is on PYTHONPATH and STRATA_FAKE_DATA is set, it replaces torchvision's
downloading datasets with small random ones of the same shapes, so the scripts run unmodified
and offline.

  STRATA_FAKE_DATA=N    samples per training set (test sets: N // 2, at least 40)
  STRATA_SEED=S         torch.manual_seed(S) before the script runs, for scripts that seed
                        nothing: the by-hand differential against real DeepSpeed
                        (tools/scripts/ds_differential.sh) starts both runs from the same weights

The fakes are torchvision.datasets.FakeData (PIL images, so the scripts' own transforms run),
with every class present: per-class accuracy code divides by each class's count.
"""

import os

_N = os.environ.get("STRATA_FAKE_DATA")

if os.environ.get("STRATA_SEED"):
    import torch as _torch

    _torch.manual_seed(int(os.environ["STRATA_SEED"]))

if _N:
    import multiprocessing as _mp
    import torchvision

    # The corpus scripts were written when Linux started a DataLoader's workers by fork. Python
    # 3.14 starts them by forkserver, which re-imports the main script in the server: a script
    # without an `if __name__ == "__main__"` guard then runs again there and the worker dies.
    # Fork is what these scripts expect (and what Python <= 3.13 does anyway).
    if _mp.get_start_method(allow_none=True) is None:
        _mp.set_start_method("fork")
    import torchvision.datasets as _datasets

    def _fake(image_size, num_classes, name):
        class Fake(_datasets.FakeData):
            def __init__(self, root=None, train=True, transform=None, target_transform=None,
                         download=False, **kwargs):
                size = int(_N) if train else max(40, int(_N) // 2)
                super().__init__(size=size, image_size=image_size, num_classes=num_classes,
                                 transform=transform, target_transform=target_transform,
                                 random_offset=0 if train else 1 << 20)
                self.classes = [str(i) for i in range(num_classes)]
                self.train = train

            def __getitem__(self, index):
                img, _ = super().__getitem__(index)
                target = index % num_classes  # every class, evenly
                if self.target_transform is not None:
                    target = self.target_transform(target)
                return img, target

        Fake.__name__ = Fake.__qualname__ = name
        return Fake

    # Module attributes too: a DataLoader's workers get the dataset pickled, by reference to
    # sitecustomize.<name>, when they start by forkserver or spawn (Python 3.14's default).
    CIFAR10 = _datasets.CIFAR10 = _fake((3, 32, 32), 10, "CIFAR10")
    CIFAR100 = _datasets.CIFAR100 = _fake((3, 32, 32), 100, "CIFAR100")
    MNIST = _datasets.MNIST = _fake((1, 28, 28), 10, "MNIST")
    FashionMNIST = _datasets.FashionMNIST = _fake((1, 28, 28), 10, "FashionMNIST")
    ImageFolder = _ImageFolder = _fake((3, 64, 64), 10, "ImageFolder")

    def _image_folder(root, transform=None, target_transform=None, **kwargs):
        return _ImageFolder(train="val" not in str(root), transform=transform,
                            target_transform=target_transform)

    _datasets.ImageFolder = _image_folder
    torchvision.datasets = _datasets
