"""PointNet classification with input and feature transforms, the usual torch code."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


# ---- PointNet (classification, input and feature transforms) -------------------------------
class STNkd(nn.Module):
    def __init__(self, k=64, width=64):
        super().__init__()
        self.k = k
        self.conv1 = nn.Conv1d(k, width, 1)
        self.conv2 = nn.Conv1d(width, 2 * width, 1)
        self.conv3 = nn.Conv1d(2 * width, 16 * width, 1)
        self.fc1 = nn.Linear(16 * width, 8 * width)
        self.fc2 = nn.Linear(8 * width, 4 * width)
        self.fc3 = nn.Linear(4 * width, k * k)
        self.bn1, self.bn2, self.bn3 = nn.BatchNorm1d(width), nn.BatchNorm1d(2 * width), nn.BatchNorm1d(16 * width)
        self.bn4, self.bn5 = nn.BatchNorm1d(8 * width), nn.BatchNorm1d(4 * width)
        self.width = width

    def forward(self, x):
        batchsize = x.size(0)
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.relu(self.bn3(self.conv3(x)))
        x = torch.max(x, 2, keepdim=True)[0]
        x = x.view(-1, 16 * self.width)
        x = F.relu(self.bn4(self.fc1(x)))
        x = F.relu(self.bn5(self.fc2(x)))
        x = self.fc3(x)
        iden = torch.eye(self.k, device=x.device, dtype=x.dtype).flatten().view(1, -1).repeat(batchsize, 1)
        x = x + iden
        return x.view(-1, self.k, self.k)


class PointNetCls(nn.Module):
    def __init__(self, k=10, width=64, feature_transform=True, dropout=0.3):
        super().__init__()
        self.stn = STNkd(3, width)
        self.conv1 = nn.Conv1d(3, width, 1)
        self.conv2 = nn.Conv1d(width, 2 * width, 1)
        self.conv3 = nn.Conv1d(2 * width, 16 * width, 1)
        self.bn1, self.bn2, self.bn3 = nn.BatchNorm1d(width), nn.BatchNorm1d(2 * width), nn.BatchNorm1d(16 * width)
        self.feature_transform = feature_transform
        if feature_transform:
            self.fstn = STNkd(width, width)
        self.fc1 = nn.Linear(16 * width, 8 * width)
        self.fc2 = nn.Linear(8 * width, 4 * width)
        self.fc3 = nn.Linear(4 * width, k)
        self.dropout = nn.Dropout(p=dropout)
        self.bn4, self.bn5 = nn.BatchNorm1d(8 * width), nn.BatchNorm1d(4 * width)
        self.width = width

    def forward(self, x):
        trans = self.stn(x)
        x = torch.bmm(x.transpose(2, 1), trans).transpose(2, 1)
        x = F.relu(self.bn1(self.conv1(x)))
        if self.feature_transform:
            trans_feat = self.fstn(x)
            x = torch.bmm(x.transpose(2, 1), trans_feat).transpose(2, 1)
        x = F.relu(self.bn2(self.conv2(x)))
        x = self.bn3(self.conv3(x))
        x = torch.max(x, 2, keepdim=True)[0].view(-1, 16 * self.width)
        x = F.relu(self.bn4(self.fc1(x)))
        x = F.relu(self.bn5(self.dropout(self.fc2(x))))
        return F.log_softmax(self.fc3(x), dim=1)
