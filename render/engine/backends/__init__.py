"""UNet/VAE backends behind one interface (base.Backend): torch, TensorRT."""
