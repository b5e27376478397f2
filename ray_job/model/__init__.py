"""The model and how it is optimised: torchvision ResNets with a CIFAR or ImageNet stem, SGD with
parameter groups, and the LR schedule as a pure function of the step."""
